"""What the monitor concludes from a window's gathered table (one row per rank, app/observability/monitor.py): a
straggler and what it costs the others, a rank whose loss departs from the others' more than batch noise explains,
and data loading that holds the step back. Every rank reaches the same verdicts from the same table; the alerts go
through logging, not warnings, so that a run started with -W ignore still hears them, from rank 0.

A rank is slow in a window when its compute exceeds ``factor`` x the median of the *other* ranks' (with two ranks
the median of all would be the mean of the pair, so a rank had to be 3x slower to pass 1.5). What the slowest rank
costs the job is the others' wait for it, as a share of the step: their idle time (step time less compute and data
wait) above its own, since it idles only for what every rank pays (the transfers, the loop's own work). Idle, not
sync wait alone: under gradient accumulation the others also wait in Lightning's per-micro-batch broadcast.
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
from typing import Any

from lightning.pytorch.utilities import rank_zero_only

from app.observability.fields import COMPUTE, DATA_WAIT, LOSS, LOSS_STD, STEP

alert = rank_zero_only(logging.getLogger(__name__).warning)


def median_of_others(values: list[float]) -> list[float]:
    """For each value, the median of all the other values (two values or more), in O(n log n): a median per rank of
    a copied list would take seconds a window at thousands of ranks."""
    ordered = sorted(values)
    others = len(values) - 1

    def kth_other(k: int, removed: int) -> float:
        """The k-th smallest value once ``ordered[removed]`` is left out."""
        return ordered[k] if k < removed else ordered[k + 1]

    medians = []
    for value in values:
        removed = bisect.bisect_left(ordered, value)  # one copy of it: ties leave the same others whichever goes
        upper = kth_other(others // 2, removed)
        medians.append(upper if others % 2 else (kth_other(others // 2 - 1, removed) + upper) / 2)
    return medians


class StragglerWatch:
    """Names a rank once it has been slow ``windows`` windows in a row, and logs what the slowest rank costs."""

    def __init__(self, factor: float, windows: int) -> None:
        self.factor = factor
        self.windows = windows
        self.events = 0  # stragglers named so far
        self._slow_windows: dict[int, int] = {}  # per rank, its slow windows in a row

    def judge(self, window: dict[str, Any], hosts: list[str], sync_measured: bool) -> dict[str, float]:
        compute = window[COMPUTE.name]
        if len(compute) < 2:
            return {"monitor/slowest_rank_ratio": 1.0, "monitor/straggler_events": self.events}
        others = median_of_others(compute)
        ratios = [seconds / median if median > 0 else 1.0 for seconds, median in zip(compute, others)]
        idle = [s - c - d for s, c, d in zip(window[STEP.name], compute, window[DATA_WAIT.name])]
        waits = [max(0.0, median - own) for own, median in zip(idle, median_of_others(idle))]  # others' wait for it
        step = statistics.median(window[STEP.name])
        for rank, ratio in enumerate(ratios):
            self._slow_windows[rank] = self._slow_windows.get(rank, 0) + 1 if ratio > self.factor else 0
            if self._slow_windows[rank] == self.windows:
                self.events += 1
                cost = (f"; the others wait {waits[rank]:.3f} s/step for it ({waits[rank] / step:.0%} of the step)"
                        if sync_measured else "; every rank waits for it")
                alert(f"straggler: rank {rank} on {hosts[rank]} computes {compute[rank]:.3f} s/step against "
                      f"a median of {others[rank]:.3f} s on the other ranks ({ratio:.1f}x) for "
                      f"{self.windows} windows in a row{cost}")
        slowest = ratios.index(max(ratios))
        metrics = {"monitor/slowest_rank_ratio": ratios[slowest], "monitor/straggler_events": self.events}
        if sync_measured:  # untimed, the others' wait in the all-reduce counts as their compute, not idle
            metrics["monitor/straggler_cost_share"] = waits[slowest] / step
        return metrics


def loss_departures(window: dict[str, Any], alert_sigmas: float) -> dict[str, float]:
    """A rank whose mean loss is further from the others' median than batch noise explains: alerted beyond
    ``alert_sigmas`` standard errors."""
    losses, stds, n = window[LOSS.name], window[LOSS_STD.name], window["losses_per_rank"]
    if len(losses) < 2 or n < 2:
        return {}
    median = statistics.median(losses)
    noise = statistics.median(stds) / math.sqrt(n)  # standard error of one rank's window mean
    departures = [abs(loss - median) / noise if noise > 0 else 0.0 for loss in losses]
    for rank, sigmas in enumerate(departures):
        if sigmas > alert_sigmas:
            alert(f"rank {rank} loss {losses[rank]:.4f} is {sigmas:.1f} standard errors from the median "
                  f"{median:.4f}: check its data and its weights")
    return {"monitor/loss_departure_sigmas/max": max(departures)}


class DataWaitWatch:
    """Warns once when a rank waits for its data longer than ``warning_share`` of the step."""

    def __init__(self, warning_share: float) -> None:
        self.warning_share = warning_share
        self._warned = False

    def judge(self, window: dict[str, Any], num_workers: int) -> dict[str, float]:
        shares = [wait / step for wait, step in zip(window[DATA_WAIT.name], window[STEP.name])]
        if max(shares) > self.warning_share and not self._warned:
            self._warned = True
            alert(f"data loading takes {max(shares):.0%} of the step time on rank {shares.index(max(shares))}: raise "
                  f"data.num_workers (now {num_workers}), set data.pin_memory true on GPUs, or keep the token files "
                  "on a local disk")
        return {"monitor/data_wait_share/max": max(shares)}
