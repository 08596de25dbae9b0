"""The parameter server's settings as one frozen record, checked as it is made: the strategy makes it from its
arguments (their meaning is in ``ParameterServerStrategy.__init__``) and hands it to the server (server.py), which
needs nothing else of the strategy."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from core.errors import check_ranges

STALENESS_POLICIES = ("drop", "scale")


@dataclass(frozen=True)
class ParameterServerSettings:
    max_staleness: int  # S: the updates a gradient may lag behind and still be applied as it is
    staleness_policy: str  # what happens to a gradient more than S updates stale: one of STALENESS_POLICIES
    stale_synchronous: bool  # a worker more than S pushes ahead of the slowest waits for its reply
    message_timeout: timedelta  # a worker silent this long (dead or hung) ends the run

    def __post_init__(self) -> None:
        check_staleness(self.max_staleness, self.staleness_policy)


def check_staleness(max_staleness: int, staleness_policy: str) -> None:
    check_ranges("trainer.strategy.init_args", {
        "max_staleness": (max_staleness >= 0, "at least 0"),
        "staleness_policy": (staleness_policy in STALENESS_POLICIES, f"one of {', '.join(STALENESS_POLICIES)}"),
    }, {"max_staleness": max_staleness, "staleness_policy": staleness_policy})
