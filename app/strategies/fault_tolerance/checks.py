"""The pre-flight checks of fault-tolerant replica groups (FaultTolerantStrategy), on the config alone: what the
groups cannot run with, refused in one line before any group starts. Nothing here imports torchft or the strategy,
so that a config can be checked where torchft is missing."""

from __future__ import annotations

import importlib.util

from app.strategies.fault_tolerance.settings import FIELD, FaultToleranceSettings
from core.errors import UserError


def check_config(settings: FaultToleranceSettings, world_size: int, global_batch_size: int, micro_batch_size: int,
                 loader_workers: int, bad_steps_action: str | None) -> None:
    """A UserError for what the replica groups (of ``world_size`` processes each) cannot run with: no torchft, a
    loader that reads ahead, a rollback, or a global batch that a smaller quorum cannot share. Before the run plan,
    which counts the groups."""
    if importlib.util.find_spec("torchft") is None:
        raise UserError("FaultTolerantStrategy needs torchft, which is not installed: pip install -e '.[ft]'")
    if loader_workers:
        raise UserError(f"data.num_workers={loader_workers}: a fault-tolerant group reads each step's samples once the "
                        "step's quorum has said which, so its loader must not read ahead: set data.num_workers 0")
    if bad_steps_action == "rollback":
        raise UserError("bad_steps.action=rollback would reload one replica group's weights from its own checkpoint "
                        "while the others go on: use stop or skip with FaultTolerantStrategy")
    groups, fewest = settings.replica_groups, settings.min_replicas
    accumulation = global_batch_size // (micro_batch_size * world_size * groups)
    each = f" of {world_size} processes" if world_size > 1 else ""
    for quorum in range(fewest, groups):  # the full quorum's arithmetic is the run plan's check
        if accumulation and global_batch_size % (quorum * world_size * accumulation):
            raise UserError(f"data.global_batch_size={global_batch_size} cannot be shared by a quorum of {quorum} "
                            f"replica groups{each} in {accumulation} equal micro-batches per process: choose a "
                            f"global batch that divides by {world_size * accumulation} x every quorum size from "
                            f"min_replicas={fewest} to {groups}, or raise {FIELD}.min_replicas")
