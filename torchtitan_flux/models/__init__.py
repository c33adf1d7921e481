"""Model families, Hugging Face folders and the torch-only forward the engines run (no torchtitan import here:
the engines import this folder in environments without it)."""
