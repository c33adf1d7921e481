"""The RL algorithm: the GRPO loss and gradient step, and the off-policy decision (admission, push cadence, controller)."""
