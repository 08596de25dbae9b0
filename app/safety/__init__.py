"""A run that is never lost and never silently wrong: checkpoints, preemption, bad steps, the replica check, the same
arithmetic on every rank."""
