"""A training run from start to stop: the trainer, its stops and checkpoints, config checks, reports."""
