"""``cohort plan``'s predicted step time against the measured one, layout by layout, on this machine.

    python -m benchmarks.plan_accuracy                            # quickstart's and the debug model's recipes
    python -m benchmarks.plan_accuracy --recipes debug --micro-batch-sizes 16 8 --rounds 3

For each recipe it ranks the layouts of 2 processes as ``cohort plan --devices 2 --calibrate`` does (the probes
and the calibration's two runs per strategy made once, here, at the start), then runs the chosen ones with the real
``cohort fit`` for ``--steps`` timed steps each after as many to warm up, one after another (app/tools/plan_trials.py:
the slowest rank's mean step time over the timed steps). Chosen: every layout that fits at the given micro batch
sizes, with ``--schedules`` and the planner's fastest number of pipeline micro-batches (all of them would multiply
the runs); with ``--rounds`` each runs that many times, in turns, and the median counts. Prints a Markdown table per
recipe with the model's prediction before and after the calibration and, over its rows, the mean absolute error
(|predicted - measured| / measured) and Spearman's rank correlation of each, those of the layouts the calibration
did not run, and the measured time of the planner's top pick against the best measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from jsonargparse import Namespace

from app.tools.cost_model import Prediction
from app.tools.plan import Ranking, calibrate_ranking, fit_runs, rank_layouts
from app.tools.plan_trials import absolute, measured_step_seconds, run_fit, scalars

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


def modelled(prediction: Prediction) -> float:
    """The step time before calibration: the model's parts without the measured unmodelled one."""
    return prediction.step_seconds - prediction.parts.get("unmodelled", 0.0)


def summary(predicted: list[float], measured: list[float]) -> str:
    error = sum(abs(p - m) / m for p, m in zip(predicted, measured)) / len(measured)
    return f"mean absolute error {error:.0%}, Spearman rank correlation {spearman(predicted, measured):.2f}"


def measure_recipe(name: str, arguments: list[str], micro_batch_sizes: list[int], schedules: list[str],
                   steps: int, rounds: int) -> None:
    args = Namespace(devices=2, nodes=1, gpu=None, device_memory=None, bandwidth=None, latency=None,
                     node_bandwidth=None, node_latency=None, steps=steps)
    ranking = calibrate_ranking(rank_layouts(args, arguments), args, arguments)
    calibration_layouts = {run.layout for calibration in ranking.calibration for run in calibration.runs}
    chosen = chosen_layouts(ranking, micro_batch_sizes, schedules)
    runs = fit_runs(ranking, args, len(ranking.ranked))
    times: dict[int, list[float]] = {index: [] for index in chosen}
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as folder:
        for _ in range(rounds):  # in turns, so that a busy spell of the machine falls on every layout alike
            for index in chosen:
                run_dir = run_fit([*absolute(arguments), *absolute(runs[index])], steps, Path(folder))
                times[index].append(measured_step_seconds(run_dir))
                prediction = ranking.ranked[index]
                parts = {name: scalars(run_dir, f"monitor/{name}/max")[1] for name in ("compute_s", "sync_wait_s")}
                print(f"  {prediction.layout.describe()}: predicted {prediction.step_seconds * 1e3:.1f} ms "
                      f"({', '.join(f'{part} {seconds * 1e3:.1f}' for part, seconds in prediction.parts.items())}), "
                      f"measured {times[index][-1] * 1e3:.1f} ms (compute {parts['compute_s'] * 1e3:.1f}, sync wait "
                      f"{parts['sync_wait_s'] * 1e3:.1f}); load average {os.getloadavg()[0]:.1f}", flush=True)
    # the median round of each, as each calibration run is a typical one (the fastest would be the least
    # disturbed, an optimistic measure the calibration is not)
    rows = [(index, ranking.ranked[index], statistics.median(times[index])) for index in chosen]
    measured = [seconds for _, _, seconds in rows]
    held_out = [row for row in rows if row[1].layout not in calibration_layouts]
    print(f"\n### {name}: {' '.join(arguments)}, 2 processes, {steps} timed steps each\n")
    print(f"compute: {ranking.speed.source}  \ncommunication: {ranking.communication_source()}  \n"
          f"calibration (separate runs, {steps} timed steps each): "
          f"{'; '.join(calibration.describe() for calibration in ranking.calibration)}\n")
    print("| planner's rank | layout | memory (estimate) | modelled | calibrated | measured | error (modelled) | "
          "error (calibrated) |\n|---|---|---|---|---|---|---|---|")
    for index, prediction, seconds in sorted(rows, key=lambda row: row[2]):
        mark = " (calibration's layout)" if prediction.layout in calibration_layouts else ""
        print(f"| {index + 1} | {prediction.layout.describe()}{mark} | {prediction.memory_bytes / 2**20:.1f} MiB | "
              f"{modelled(prediction) * 1e3:.1f} ms | {prediction.step_seconds * 1e3:.1f} ms | {seconds * 1e3:.1f} ms | "
              f"{(modelled(prediction) - seconds) / seconds:+.0%} | {(prediction.step_seconds - seconds) / seconds:+.0%} |")
    print(f"\n{len(rows)} layouts. Modelled: {summary([modelled(row[1]) for row in rows], measured)}. Calibrated: "
          f"{summary([row[1].step_seconds for row in rows], measured)}; without the calibration's own layouts "
          f"({len(held_out)}): {summary([row[1].step_seconds for row in held_out], [row[2] for row in held_out])}. "
          f"Top pick measured {measured[0] * 1e3:.1f} ms vs best measured {min(measured) * 1e3:.1f} ms "
          f"({measured[0] / min(measured) - 1:+.0%})\n", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--micro-batch-sizes", nargs="+", type=int, default=[16, 8])
    parser.add_argument("--schedules", nargs="+", default=["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each run, after as many to warm up")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each layout, in turns; their median counts")
    options = parser.parse_args()
    for name in options.recipes:
        measure_recipe(name, RECIPES[name], options.micro_batch_sizes, options.schedules, options.steps,
                       options.rounds)


if __name__ == "__main__":
    main()
