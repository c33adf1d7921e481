"""Rank 0's rollout side: ``fleet.Rollouts`` (engines, scheduler, event pump), prompt split and batch layout."""
