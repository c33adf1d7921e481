"""Rank 0's rollout side: ``rollouts.Rollouts`` (the engine fleet, the event pump, the group table, the collection
policies), multi-turn episodes, seeds, prompt split, batch layout, placement, held-out evaluation."""
