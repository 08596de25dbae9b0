"""A run that is never lost and never silently wrong: checkpoints, preemption, bad steps, the replica check, the same
arithmetic on every rank, and what the launcher tells a restarted process."""

import torch.distributed as dist


def cpu_group_over_every_rank() -> dist.ProcessGroup:
    """A gloo group of every rank, for the small flags the ranks agree on at step ends (a stop signal, a finished
    save): CPU tensors, since on NCCL a device tensor read back at every step would stall the device's queue. The
    default group itself where that is gloo already; call it on every rank alike (a new group is a collective)."""
    return dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
