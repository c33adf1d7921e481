"""Rank 0's rollout side: the engine fleet, the scheduler that dispatches and collects, and batch layout."""
