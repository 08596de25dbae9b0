"""Fault-tolerant replica groups with torchft: the groups' strategy, its settings, and the job that starts them."""
