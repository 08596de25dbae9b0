"""What the launcher tells a process through its environment: how many times torchrun has restarted it, which
fault-tolerant replica group it is in, and that group's job folder. The fault-tolerant job sets the last two for
every group it starts (app/strategies/fault_tolerance/job.py; scripts/torchrun.sh for groups started by hand); the
groups' strategy and the pre-flight checks that resume a restarted run read them, so they live below both."""

from __future__ import annotations

import os

REPLICA_GROUP_ENV = "COHORT_REPLICA_GROUP"  # set by the job for the processes of replica group G
RUN_VERSION_ENV = "COHORT_RUN_VERSION"  # the job's lightning_logs/VERSION folder, where each group has its own


def torchrun_restart() -> int:
    """How many times torchrun has restarted this job's ranks after a failure (0: the first attempt, or no torchrun);
    the CLI reads it too, to continue a restarted job's run."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def replica_group() -> int | None:
    """This process's replica group in a fault-tolerant job; None in the process that starts the job, or elsewhere."""
    group = os.environ.get(REPLICA_GROUP_ENV)
    return None if group is None else int(group)
