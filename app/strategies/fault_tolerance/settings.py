"""A fault-tolerant job's settings as one frozen record: the strategy makes it from its arguments (their meaning is
in ``FaultTolerantStrategy.__init__``) and hands it to the launcher of the job (job.py), which needs nothing else of
the strategy."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class FaultToleranceSettings:
    replica_groups: int  # copies of the model, each one process (one torchrun)
    min_replicas: int  # groups a step needs to commit
    lighthouse: str | None  # http://host:port of a running lighthouse; None: the job starts one
    max_restarts: int  # times torchrun restarts a group whose process died
    timeout: timedelta  # the longest a quorum, the gradient all-reduce or a recovery may take
    heartbeat_timeout: timedelta  # a group silent this long is dead to the lighthouse the job starts
