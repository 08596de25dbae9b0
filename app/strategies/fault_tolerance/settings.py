"""A fault-tolerant job's settings as one frozen record, checked as it is made: the pre-flight checks make it from
the config (checks.py), the strategy from its arguments (their meaning is in ``FaultTolerantStrategy.__init__``,
whose defaults these are) and hands it to the launcher of the job (job.py), which needs nothing else of the
strategy."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from core.errors import check_ranges

FIELD = "trainer.strategy.init_args"


@dataclass(frozen=True)
class FaultToleranceSettings:
    replica_groups: int = 3  # copies of the model, each a torchrun of trainer.devices x num_nodes processes
    min_replicas: int = 1  # groups a step needs to commit
    lighthouse: str | None = None  # http://host:port of a running lighthouse; None: the job starts one
    max_restarts: int = 10  # times torchrun restarts a group whose process died
    timeout: timedelta = timedelta(seconds=30)  # the longest a quorum, the gradient all-reduce or a recovery may take
    heartbeat_timeout: timedelta = timedelta(seconds=3)  # a group silent this long is dead to the job's lighthouse
    start_timeout: timedelta = timedelta(minutes=5)  # at the start, how long the groups up wait for the others

    def __post_init__(self) -> None:
        groups, fewest = self.replica_groups, self.min_replicas
        check_ranges(FIELD, {"replica_groups": (groups >= 1, "at least 1"),
                             "min_replicas": (1 <= fewest <= groups, f"between 1 and replica_groups={groups}"),
                             "max_restarts": (self.max_restarts >= 0, ">= 0")}, vars(self))
