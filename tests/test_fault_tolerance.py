"""Fault-tolerant replica groups (app/strategies/fault_tolerance/): groups that train as one process does, a group
killed mid-run that comes back with a live group's state while the others go on, and one line for what cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import (
    CLIP,
    CONFIG_DIR,
    QUIET,
    assert_comparable_runs_agree,
    assert_one_line_error_in_process,
    assert_weights_agree,
    assert_weights_equal,
    batch_sizes,
    fit,
    fit_in_process,
    free_port,
    last_checkpoint_contents,
    scalars,
)
from tests.processes import run_cohort

FAULT_TOLERANT = ["-c", str(CONFIG_DIR / "trainer/fault_tolerant_cpu.yaml")]
GROUPS_OF_TWO = ["-c", str(CONFIG_DIR / "trainer/fault_tolerant_groups_cpu.yaml")]  # 2 groups x 2 processes, FSDP2
GROUPS = "--trainer.strategy.init_args.replica_groups"


def group_run(job_dir: Path, group: int) -> Path:
    """A folder that looks like a one-process run's (lightning_logs/version_0) onto one group of a job's run, so the
    helpers that read runs read it."""
    view = job_dir / f"group_{group}"
    (view / "lightning_logs").mkdir(parents=True, exist_ok=True)
    link = view / "lightning_logs" / "version_0"
    if not link.exists():
        link.symlink_to(job_dir / "lightning_logs" / "version_0" / f"replica_group_{group}")
    return view


@pytest.mark.slow
def test_two_replica_groups_train_as_one_process_does(tmp_path: Path, comparable_run_args: list[str],
                                                      one_process_comparable_run: Path) -> None:
    """Each group reads half of every global batch, and the gradient is their mean: the same steps as one process
    reading the whole batch, up to the order of sums (the tolerances of assert_comparable_runs_agree)."""
    job = fit(tmp_path, [*comparable_run_args, *FAULT_TOLERANT, GROUPS, "2"])
    for group in range(2):
        assert_comparable_runs_agree(one_process_comparable_run, group_run(job, group))
        assert scalars(group_run(job, group), "fault_tolerance/quorum_size") == [2.0] * 4


@pytest.mark.slow
def test_two_groups_of_two_processes_train_as_one_process_does(tmp_path: Path, comparable_run_args: list[str],
                                                               one_process_comparable_run: Path) -> None:
    """Each group shards the model over its two processes (FSDP2) and reads half of every global batch, a quarter on
    each process; process r averages its gradient shards with process r of the other group. The same steps as one
    process reading the whole batch, up to the order of sums (assert_comparable_runs_agree's tolerances)."""
    job = fit(tmp_path, [*comparable_run_args, *GROUPS_OF_TWO, *batch_sizes(8, 2)])
    for group in range(2):
        assert_comparable_runs_agree(one_process_comparable_run, group_run(job, group))
        assert scalars(group_run(job, group), "fault_tolerance/quorum_size") == [2.0] * 4
        assert scalars(group_run(job, group), "fault_tolerance/samples_per_group") == [4.0] * 4


@pytest.mark.slow
def test_a_killed_group_rejoins_with_a_live_groups_state(tmp_path: Path, debug_run_args: list[str]) -> None:
    """Group 1 of 3 dies at step 3; torchrun restarts it and it takes a live group's weights, optimizer state and
    step, while the other two train on, each reading half of every global batch instead of a third. So every step
    is one process's step up to the order of sums (assert_comparable_runs_agree's tolerances): the clipped gradient
    norm of every committed step, the validation losses at steps 50 and 100, the final weights. Every group ends
    with the same weights, bitwise. Group 1 comes back mid-run whatever the machine's speed: the others train on
    without it until step 10, where they wait for its new process (tests.helpers.RejoinMidRun)."""
    steps = 100
    run = [*debug_run_args, *batch_sizes(12, 4), "--trainer.max_steps", str(steps), "--val_every_n_steps",
           str(steps // 2), "--trainer.check_val_every_n_epoch", "null", "--trainer.gradient_clip_val", str(CLIP)]
    job = fit(tmp_path / "job", [*run, *FAULT_TOLERANT, GROUPS, "3",
                                 "--trainer.callbacks+=tests.helpers.KillReplicaGroup",
                                 "--trainer.callbacks.group=1", "--trainer.callbacks.step=3",
                                 "--trainer.callbacks+=tests.helpers.RejoinMidRun",
                                 f"--trainer.callbacks.folder={tmp_path}", "--trainer.callbacks.group=1",
                                 "--trainer.callbacks.step=10"])
    one_process = fit_in_process(tmp_path / "one_process", run)
    finals = [last_checkpoint_contents(group_run(job, group)) for group in range(3)]
    assert [final["global_step"] for final in finals] == [steps] * 3
    for final in finals[1:]:
        assert_weights_equal(finals[0]["state_dict"], final["state_dict"])
    assert scalars(group_run(job, 1), "fault_tolerance/recoveries")[-1] == 1.0
    quorum = scalars(group_run(job, 0), "fault_tolerance/quorum_size")
    assert quorum[0] == 3.0 and 2.0 in quorum, quorum  # all three at the start, two while group 1 was down
    norms = last_value_per_step(group_run(job, 0), "train/grad_norm")  # a step that did not commit is logged again
    expected = last_value_per_step(one_process, "train/grad_norm")
    assert norms.keys() == expected.keys() and list(norms.values()) == pytest.approx(list(expected.values()), rel=1e-4)
    assert scalars(group_run(job, 0), "val/loss") == pytest.approx(scalars(one_process, "val/loss"), rel=1e-4)
    assert_weights_agree(one_process, group_run(job, 0))
    # validation follows the committed steps in the group that came back too (it misses step 50 if it came later)
    validated = scalars(group_run(job, 1), "val/loss")
    assert validated and validated == scalars(group_run(job, 0), "val/loss")[-len(validated):], validated


@pytest.mark.slow
def test_a_process_killed_in_a_group_of_two_rejoins_with_its_peers_shards(tmp_path: Path,
                                                                          debug_run_args: list[str]) -> None:
    """Process 1 of group 1 (of 2 groups of 2 processes) dies at step 3; torchrun restarts the group, whose process r
    takes process r's shards of group 0 (weights, optimizer state, step), while group 0 trains on alone, reading the
    whole global batch. So every committed step is one process's step up to the order of sums, and both groups end
    with the same weights, bitwise, exiting 0. Group 0 holds at step 8 until group 1's new processes have started
    (tests.helpers.RejoinMidRun), whatever the machine's speed."""
    steps = 12
    run = [*debug_run_args, "--trainer.max_steps", str(steps), "--trainer.limit_val_batches", "0",
           "--trainer.gradient_clip_val", str(CLIP)]
    job = fit(tmp_path / "job", [*run, *GROUPS_OF_TWO, *batch_sizes(8, 2),
                                 "--trainer.callbacks+=tests.helpers.KillReplicaGroup", "--trainer.callbacks.group=1",
                                 "--trainer.callbacks.step=3", "--trainer.callbacks.rank=1",
                                 "--trainer.callbacks+=tests.helpers.RejoinMidRun",
                                 f"--trainer.callbacks.folder={tmp_path}", "--trainer.callbacks.group=1",
                                 "--trainer.callbacks.step=8"])
    one_process = fit_in_process(tmp_path / "one_process", [*run, *batch_sizes(8, 4)])
    finals = [last_checkpoint_contents(group_run(job, group)) for group in range(2)]
    assert [final["global_step"] for final in finals] == [steps] * 2
    assert_weights_equal(finals[0]["state_dict"], finals[1]["state_dict"])
    assert scalars(group_run(job, 1), "fault_tolerance/recoveries")[-1] == 1.0
    quorum = scalars(group_run(job, 0), "fault_tolerance/quorum_size")
    assert quorum[0] == 2.0 and 1.0 in quorum and quorum[-1] == 2.0, quorum  # alone while group 1 was down
    norms = last_value_per_step(group_run(job, 0), "train/grad_norm")  # a step that did not commit is logged again
    expected = last_value_per_step(one_process, "train/grad_norm")
    assert norms.keys() == expected.keys() and list(norms.values()) == pytest.approx(list(expected.values()), rel=1e-4)
    assert_weights_agree(one_process, group_run(job, 0))


def last_value_per_step(run_dir: Path, tag: str) -> dict[int, float]:
    """{step: the last value logged at it}, in step order, from a run's TensorBoard events."""
    events = EventAccumulator(str(run_dir / "lightning_logs" / "version_0"), size_guidance={"scalars": 0})
    events.Reload()
    return dict(sorted({event.step: event.value for event in events.Scalars(tag)}.items()))


@pytest.mark.slow
def test_sigterm_stops_every_group_at_a_checkpoint_and_the_job_resumes(tmp_path: Path,
                                                                     debug_run_args: list[str]) -> None:
    """SIGTERM to cohort reaches every group: each checkpoints after its step and the job exits 143, saying how to
    resume; --ckpt_path last resumes every group from the newest of them, and they train to the end alike."""
    args = ["fit", *debug_run_args, *FAULT_TOLERANT, *batch_sizes(8, 4), "--trainer.max_steps", "12",
            "--trainer.limit_val_batches", "0", *QUIET]
    stopped = run_cohort([*args, "--trainer.callbacks+=tests.helpers.SignalJobAtStep", "--trainer.callbacks.step=4"],
                         cwd=tmp_path)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    steps = [last_checkpoint_contents(group_run(tmp_path, group))["global_step"] for group in range(2)]
    assert all(4 <= step < 12 for step in steps), steps
    resumed = run_cohort([*args, "--ckpt_path", "last"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    finals = [last_checkpoint_contents(group_run(tmp_path, group)) for group in range(2)]
    assert [final["global_step"] for final in finals] == [12, 12]
    assert_weights_equal(finals[0]["state_dict"], finals[1]["state_dict"])


@pytest.mark.slow
def test_a_lighthouse_that_dies_mid_run_ends_the_job_in_one_line(tmp_path: Path, debug_run_args: list[str]) -> None:
    result = run_cohort(["fit", *debug_run_args, *FAULT_TOLERANT, *batch_sizes(8, 4), *QUIET,
                         "--trainer.max_steps", "200", "--trainer.limit_val_batches", "0",
                         "--trainer.callbacks+=tests.helpers.KillLighthouseAtStep", "--trainer.callbacks.step=3"],
                        cwd=tmp_path, timeout=120)
    assert result.returncode == 1
    assert ("cohort: error: torchft's lighthouse exited with code -9 while the groups trained, so they could not "
            "agree on another step") in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize(("args", "expected"), [
    ([GROUPS, "2", "--trainer.strategy.init_args.min_replicas", "3"], "min_replicas=3 must be between 1 and"),
    (["--trainer.num_nodes", "2", *batch_sizes(8, 2)], "trainer.num_nodes=2 but no launcher started this process"),
    ([*GROUPS_OF_TWO, *batch_sizes(4, 2)], "data.global_batch_size=4 is not a multiple of data.micro_batch_size=2 x 2 "
                                           "replica groups of 2 processes (2 devices x 1 nodes) = 8"),
    ([*GROUPS_OF_TWO, GROUPS, "3", *batch_sizes(6, 1)], "data.global_batch_size=6 cannot be shared by a quorum of 2 "
                                                        "replica groups of 2 processes in 1 equal micro-batches"),
    (["--data.num_workers", "2"], "data.num_workers=2: a fault-tolerant group reads"),
    (["--bad_steps.action", "rollback"], "bad_steps.action=rollback would reload one replica group"),
    (batch_sizes(12, 4), "data.global_batch_size=12 is not a multiple of data.micro_batch_size=4 x 2 replica groups"),
    ([GROUPS, "3", *batch_sizes(9, 3)], "data.global_batch_size=9 cannot be shared by a quorum of 2 replica groups"),
])
def test_what_replica_groups_cannot_run_is_one_line(args: list[str], expected: str, tmp_path: Path,
                                                    debug_run_args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert_one_line_error_in_process(["fit", *debug_run_args, *FAULT_TOLERANT, *args], tmp_path, expected, monkeypatch)


def test_a_lighthouse_that_does_not_answer_is_one_line(tmp_path: Path, debug_run_args: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    address = f"http://127.0.0.1:{free_port()}"
    line = assert_one_line_error_in_process(
        ["fit", *debug_run_args, *FAULT_TOLERANT, *batch_sizes(8, 4), "--trainer.strategy.init_args.lighthouse", address], tmp_path, f"the lighthouse at {address} does not answer",
        monkeypatch)
    assert "torchft_lighthouse" in line
