"""The pre-flight checks of fault-tolerant replica groups (FaultTolerantStrategy), on the config alone: what the
groups cannot run with, refused in one line before any group starts. Nothing here imports torchft or the strategy,
so that a config can be checked where torchft is missing."""

from __future__ import annotations

import importlib.util

from app.strategies.fault_tolerance.settings import FIELD, FaultToleranceSettings
from core.errors import UserError


def check_config(settings: FaultToleranceSettings, world_size: int, global_batch_size: int, micro_batch_size: int,
                 loader_workers: int, bad_steps_action: str | None) -> None:
    """A UserError for what the replica groups cannot run with: no torchft, more than one process per group, a loader
    that reads ahead, a rollback, or a global batch that a smaller quorum cannot share. Before the run plan, which
    counts the groups."""
    if importlib.util.find_spec("torchft") is None:
        raise UserError("FaultTolerantStrategy needs torchft, which is not installed: pip install -e '.[ft]'")
    if world_size != 1:
        raise UserError(f"trainer.devices x trainer.num_nodes = {world_size} under FaultTolerantStrategy, whose "
                        f"replica groups are one process each: set trainer.devices 1 and num_nodes 1, and raise "
                        f"{FIELD}.replica_groups instead")
    if loader_workers:
        raise UserError(f"data.num_workers={loader_workers}: a fault-tolerant group reads each step's samples once the "
                        "step's quorum has said which, so its loader must not read ahead: set data.num_workers 0")
    if bad_steps_action == "rollback":
        raise UserError("bad_steps.action=rollback would reload one replica group's weights from its own checkpoint "
                        "while the others go on: use stop or skip with FaultTolerantStrategy")
    groups, fewest = settings.replica_groups, settings.min_replicas
    accumulation = global_batch_size // (micro_batch_size * groups)
    for quorum in range(fewest, groups):  # the full quorum's arithmetic is the run plan's check
        if accumulation and global_batch_size % (quorum * accumulation):
            raise UserError(f"data.global_batch_size={global_batch_size} cannot be shared by a quorum of {quorum} "
                            f"replica groups in {accumulation} equal micro-batches each: choose a global batch that "
                            f"divides by {accumulation} x every quorum size from min_replicas={fewest} to "
                            f"{groups}, or raise {FIELD}.min_replicas")
