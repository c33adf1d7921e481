"""Rank 0's rollout side: ``rollouts.Rollouts`` (engines, scheduler, event pump), prompt split, batch layout,
placement, held-out evaluation."""
