"""``cohort plan``'s predicted step time against the measured one, layout by layout, on this machine.

    python -m benchmarks.plan_accuracy                            # quickstart's and the debug model's recipes
    python -m benchmarks.plan_accuracy --recipes debug --steps 6 --micro-batch-sizes 16 8 --rounds 2

For each recipe it ranks the layouts of 2 processes as ``cohort plan --devices 2`` does (the probes measured once,
here, at the start), then runs the chosen ones with the real ``cohort fit`` for ``--steps`` steps each, one after
another (app/tools/plan_trials.py: the median of the slowest rank's step time after two warm-up steps). Chosen:
every layout that fits at the given micro batch sizes, with ``--schedules`` and the planner's fastest number of
pipeline micro-batches (all of them would multiply the runs); with ``--rounds`` each runs that many times, in
turns, and its fastest counts. Prints a Markdown table per recipe and, over its rows, the mean absolute error
(|predicted - measured| / measured), Spearman's rank correlation, and the measured time of the planner's top pick
against the best measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from jsonargparse import Namespace

from app.tools.plan import Ranking, fit_runs, rank_layouts
from app.tools.plan_trials import WARMUP_STEPS, absolute, measured_step_seconds, run_fit, scalars

RECIPES = {
    "quickstart": ["-c", "configs/quickstart.yaml"],
    "debug": ["-c", "configs/quickstart.yaml", "--model.model_name", "debug", "--data.sequence_length", "64"],
}


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    result = [0.0] * len(values)
    for place, index in enumerate(order):
        result[index] = place
    return result


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1)) if n > 1 else float("nan")


def chosen_layouts(ranking: Ranking, micro_batch_sizes: list[int], schedules: list[str]) -> list[int]:
    """Places in the ranking of the layouts to run: one per strategy, schedule, micro batch and checkpointing (the
    planner's fastest number of pipeline micro-batches)."""
    chosen, seen = [], set()
    for index, prediction in enumerate(ranking.ranked):
        layout = prediction.layout
        key = (layout.strategy, layout.schedule, layout.micro_batch_size, layout.activation_checkpointing)
        if (layout.micro_batch_size in micro_batch_sizes and key not in seen
                and (layout.strategy != "pipeline" or layout.schedule in schedules)):
            seen.add(key)
            chosen.append(index)
    return chosen


def measure_recipe(name: str, arguments: list[str], micro_batch_sizes: list[int], schedules: list[str],
                   steps: int, rounds: int) -> None:
    args = Namespace(devices=2, nodes=1, gpu=None, device_memory=None, bandwidth=None, latency=None,
                     node_bandwidth=None, node_latency=None)
    ranking = rank_layouts(args, arguments)
    chosen = chosen_layouts(ranking, micro_batch_sizes, schedules)
    runs = fit_runs(ranking, Namespace(devices=2, nodes=1), len(ranking.ranked))
    times: dict[int, list[float]] = {index: [] for index in chosen}
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as folder:
        for _ in range(rounds):  # in turns, so that a busy spell of the machine falls on every layout alike
            for index in chosen:
                run_dir = run_fit([*absolute(arguments), *absolute(runs[index])], steps, Path(folder))
                times[index].append(measured_step_seconds(run_dir))
                prediction = ranking.ranked[index]
                parts = {name: statistics.median(scalars(run_dir, f"monitor/{name}/max")[WARMUP_STEPS:])
                         for name in ("compute_s", "sync_wait_s")}
                print(f"  {prediction.layout.describe()}: predicted {prediction.step_seconds * 1e3:.1f} ms "
                      f"({', '.join(f'{part} {seconds * 1e3:.1f}' for part, seconds in prediction.parts.items())}), "
                      f"measured {times[index][-1] * 1e3:.1f} ms (compute {parts['compute_s'] * 1e3:.1f}, sync wait "
                      f"{parts['sync_wait_s'] * 1e3:.1f}); load average {os.getloadavg()[0]:.1f}", flush=True)
    # the fastest round of each: the least disturbed by the machine's other work
    rows = [(ranking.ranked[index], min(times[index])) for index in chosen]
    predicted, measured = [row[0].step_seconds for row in rows], [row[1] for row in rows]
    error = sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(rows)
    best = min(measured)
    print(f"\n### {name}: {' '.join(arguments)}, 2 processes, {steps} steps each\n")
    print(f"compute: {ranking.speed.source}  \ncommunication: {ranking.communication_source()}\n")
    print("| planner's rank | layout | memory (estimate) | predicted | measured | error |\n|---|---|---|---|---|---|")
    for (prediction, seconds), index in sorted(zip(rows, chosen), key=lambda row: row[0][1]):
        print(f"| {index + 1} | {prediction.layout.describe()} | {prediction.memory_bytes / 2**20:.1f} MiB | "
              f"{prediction.step_seconds * 1e3:.1f} ms | {seconds * 1e3:.1f} ms | "
              f"{(prediction.step_seconds - seconds) / seconds:+.0%} |")
    print(f"\n{len(rows)} layouts: mean absolute error {error:.0%}, Spearman rank correlation "
          f"{spearman(predicted, measured):.2f}, top pick measured {measured[0] * 1e3:.1f} ms vs best measured "
          f"{best * 1e3:.1f} ms ({measured[0] / best - 1:+.0%})\n", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--micro-batch-sizes", nargs="+", type=int, default=[16, 8])
    parser.add_argument("--schedules", nargs="+", default=["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each layout, in turns; the fastest counts")
    options = parser.parse_args()
    for name in options.recipes:
        measure_recipe(name, RECIPES[name], options.micro_batch_sizes, options.schedules, options.steps,
                       options.rounds)


if __name__ == "__main__":
    main()
