"""torchtitan_flux: asynchronous GRPO on torchtitan."""
