"""Asynchronous training through a parameter server (app/strategies/parameter_server/): real runs of a server and
workers on CPU processes over gloo, with the shipped preset configs/trainer/async_ps_cpu.yaml; a stopped run resumed; a
killed worker and a killed server; the mistakes refused before start."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace

from app.strategies.parameter_server.strategy import check_asynchronous
from core.errors import UserError
from tests.helpers import (
    CONFIG_DIR, QUIET, answered_pushes, assert_comparable_runs_agree, batch_sizes, fit, free_port,
    last_checkpoint, one_line_error, run_cohort, scalars,
)
from tests.processes import run_cohorts

ASYNC = ["-c", str(CONFIG_DIR / "trainer/async_ps_cpu.yaml")]
ONE_WORKER = [*ASYNC, "--trainer.devices", "2"]


def staleness(max_staleness: int, policy: str) -> list[str]:
    return ["--trainer.strategy.init_args.max_staleness", str(max_staleness),
            "--trainer.strategy.init_args.staleness_policy", policy]


def summary_counts(output: str) -> tuple[dict[int, int], int, int]:
    """From the server's end-of-run line: the staleness counts of the applied gradients, how many of them had their
    learning rate scaled, and how many were dropped."""
    line = re.search(r"parameter server: \d+ updates applied, (\d+) of them .*, (\d+) dropped.*counts \{([^}]*)\}",
                     output)
    assert line, output[-3000:]
    counts = {int(stale): int(count) for stale, count in re.findall(r"(\d+): (\d+)", line.group(3))}
    return counts, int(line.group(1)), int(line.group(2))


@pytest.mark.slow
def test_one_worker_without_staleness_trains_exactly_as_one_process(tmp_path: Path, comparable_run_args: list[str],
                                                                     one_process_comparable_run: Path) -> None:
    """With one worker every gradient is fresh and the batches come in the synchronous order: the server's updates
    are one process's, so the validation losses and the final weights agree."""
    run = fit(tmp_path / "async", [*comparable_run_args, *ONE_WORKER, *staleness(0, "drop")])
    assert_comparable_runs_agree(one_process_comparable_run, run)
    assert scalars(run, "async/staleness_max") == [0.0] * 4


@pytest.mark.slow
def test_equal_workers_without_staleness_train_as_synchronous_sgd(tmp_path: Path, comparable_run_args: list[str],
                                                                   one_process_comparable_run: Path) -> None:
    """Two workers, max_staleness 0, drop: every applied gradient is fresh (the stale ones are dropped and their
    batches handed out again), so the run is serial SGD on global batches, the synchronous run's, in a slightly
    permuted order. Tolerance: the validation loss after the last of 4 steps within 2 % (the order alone moves it
    by well under 1 % here)."""
    run_dir = tmp_path / "async"
    run_dir.mkdir()
    result = run_cohort(["fit", *comparable_run_args, *ASYNC, *staleness(0, "drop"), *QUIET], cwd=run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    counts, _, _ = summary_counts(result.stdout + result.stderr)
    assert counts == {0: 4}
    assert scalars(run_dir, "val/loss")[-1] == pytest.approx(scalars(one_process_comparable_run, "val/loss")[-1],
                                                             rel=0.02)


BEHIND = 3  # worker 2 waits for 3 of worker 1's pushes per step of its own: its gradients are at least 2 stale
STOPPED_AT = 21  # updates applied when SIGUSR1 (at update 20) has stopped the run
STEPS = 40


def worker_2_lags(out_dir: Path) -> list[str]:
    """The flags that make worker 2 lag worker 1 by BEHIND pushes (tests/helpers.py LagBehindWorker), with each
    worker's answered pushes counted into ``out_dir``."""
    out_dir.mkdir()
    return ["--trainer.callbacks+=tests.helpers.LagBehindWorker", f"--trainer.callbacks.out_dir={out_dir}",
            "--trainer.callbacks.rank=2", "--trainer.callbacks.other=1", f"--trainer.callbacks.behind={BEHIND}"]


@pytest.mark.slow
def test_a_slow_worker_is_stale_within_the_bound_and_a_stopped_run_resumes(tmp_path: Path,
                                                                          debug_run_args: list[str]) -> None:
    """Worker 2 waits for BEHIND of worker 1's pushes in each of its steps, so its gradients arrive at least
    BEHIND - 1 = 2 updates stale, and worker 1's at most 1 (worker 2 applies at most one update between two of
    worker 1's): a lag set by the order of pushes, not by the machine's speed. With max_staleness 1 and drop,
    nothing older than 1 is applied: every worker-1 push is applied, every worker-2 push the server answered was
    dropped. SIGUSR1 to the server at update 20 makes it checkpoint and stop every worker; the checkpoint's data
    position says every batch handed out was applied exactly once or is to be handed out again. The run resumes
    from it to STEPS updates with the scale policy: then each of the slow worker's gradients is applied, more than 1
    stale, with its learning rate scaled, and no fresh one is."""
    run = [*debug_run_args, *ASYNC, *batch_sizes(8, 4), "--trainer.max_steps", str(STEPS), *QUIET]
    stopped = run_cohort(["fit", *run, *staleness(1, "drop"), *worker_2_lags(tmp_path / "stopped"),
                          "--trainer.callbacks+=tests.helpers.SignalAtStep", "--trainer.callbacks.signal_name=SIGUSR1",
                          f"--trainer.callbacks.step={STOPPED_AT - 1}", "--trainer.callbacks.micro_batch=0"],
                         cwd=tmp_path)
    assert stopped.returncode == 128 + 10, stopped.stderr[-3000:]
    counts, scaled, dropped = summary_counts(stopped.stdout + stopped.stderr)
    checkpoint = torch.load(last_checkpoint(tmp_path), map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == STOPPED_AT == answered_pushes(tmp_path / "stopped", 1)
    assert counts == {0: STOPPED_AT}  # worker 1's, each fresh: worker 2's were never applied
    slow_pushes = answered_pushes(tmp_path / "stopped", 2)
    assert scaled == 0 and dropped == slow_pushes > 0, (dropped, slow_pushes)
    position = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    unapplied = position["unapplied_steps"]
    assert len(set(unapplied)) == len(unapplied) and all(step < position["next_step"] for step in unapplied)
    assert position["next_step"] == checkpoint["global_step"] + len(unapplied)  # none applied twice, none lost

    resumed = run_cohort(["fit", *run, *staleness(1, "scale"), *worker_2_lags(tmp_path / "resumed"),
                          "--ckpt_path", "last"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    counts, scaled, _ = summary_counts(resumed.stdout + resumed.stderr)  # counted over both runs
    assert torch.load(last_checkpoint(tmp_path), map_location="cpu", weights_only=True)["global_step"] == STEPS
    fast_pushes, slow_pushes = (answered_pushes(tmp_path / "resumed", worker) for worker in (1, 2))
    assert fast_pushes + slow_pushes == STEPS - STOPPED_AT  # scale drops nothing
    assert sum(counts.values()) == STEPS
    assert scaled == sum(count for stale, count in counts.items() if stale >= BEHIND - 1) == slow_pushes > 0, \
        (counts, scaled, slow_pushes)


def run_as_nodes(args: list[str], cwd: Path, nodes: int = 3, timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """``cohort ARGS`` as ``nodes`` machines of one process each, the environment torchrun (or srun) gives each:
    a rank that dies leaves the others running, as on separate nodes (Lightning's own launcher, on one machine,
    ends every process when one dies). A process still running ``timeout`` seconds after the start hangs: every one
    is killed and the test fails."""
    port = str(free_port())
    node_args = ["fit", *args, "--trainer.devices", "1", "--trainer.num_nodes", str(nodes)]
    return run_cohorts([(node_args, {"TORCHELASTIC_RUN_ID": "job", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                     "WORLD_SIZE": str(nodes), "RANK": str(rank), "GROUP_RANK": str(rank),
                                     "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) for rank in range(nodes)],
                       cwd, timeout)


@pytest.mark.slow
@pytest.mark.parametrize("killed", [2, 0], ids=["worker", "server"])
def test_a_killed_rank_ends_the_run_within_the_timeout(killed: int, tmp_path: Path, debug_run_args: list[str]) -> None:
    """SIGKILL a worker: the server, still hearing from the other, names the silent one once the strategy's
    timeout (10 s here) has passed, and the other worker loses the server. SIGKILL the server: both workers lose
    it at their next message. Either way every process ends, with a line that says so (one that never ends is a
    hang, which run_as_nodes fails on: the run has steps for hours)."""
    results = run_as_nodes([*debug_run_args, *ASYNC, "--trainer.strategy.init_args.timeout", "0:00:10",
                            "--trainer.max_steps", "100000", "--trainer.callbacks+=tests.helpers.KillRank",
                            f"--trainer.callbacks.rank={killed}", "--trainer.callbacks.step=3", *QUIET], tmp_path)
    assert results[killed].returncode == -signal.SIGKILL
    for rank, result in enumerate(results):
        if rank == killed:
            continue
        last_line = result.stderr.strip().splitlines()[-1]
        expected = (f"parameter server: worker rank {killed} has sent nothing for" if rank == 0 else
                    "another process of this run ended")
        assert result.returncode == 1 and last_line.startswith("cohort: error: ") and expected in last_line, \
            result.stderr[-3000:]


def test_what_the_parameter_server_cannot_run_with_is_refused(debug_run_args: list[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Before anything starts, in one line (fp16's refusal is a GPU's: a CPU runs 16-mixed as bf16-mixed)."""
    for extra, expected in [
        (["--trainer.devices", "1"], "needs a server and at least one worker"),
        (["--local_updates.method", "diloco"], "local_updates.method=diloco works on DDP's all-reduce"),
        (staleness(-1, "drop"), "max_staleness=-1 must be at least 0"),
        (staleness(1, "ignore"), "staleness_policy='ignore' must be one of drop, scale"),
    ]:
        assert expected in one_line_error(["fit", *debug_run_args, *ASYNC, *extra], monkeypatch)


def test_fp16_is_refused_where_it_would_run() -> None:
    """On a GPU: the loss scale would live on each worker, its skipped steps on the server."""
    config = Namespace(trainer=Namespace(strategy=Namespace(init_args=Namespace(max_staleness=4,
                                                                                staleness_policy="scale"))))
    with pytest.raises(UserError, match="16-mixed under the parameter server"):
        check_asynchronous(config, 3, "16-mixed")
