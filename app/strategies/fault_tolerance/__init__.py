"""Fault-tolerant replica groups with torchft: the groups' strategy, and the job that starts them."""
