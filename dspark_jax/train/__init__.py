"""Training infrastructure: optimizer and schedule, orbax checkpoints, preemption, metrics, progress."""
