"""What is trained on: tasks, datasets, rewards and evaluation."""
