"""A GPU fit run to its end, and what it must leave behind: the check that would have caught the monitor's crash at
the end of every GPU run (its summary read a CUDA series that it never logged, before the final checkpoint).

    python -m benchmarks.gpu_fit_to_end                   # the quickstart on one GPU, bf16-mixed, 20 steps
    python -m benchmarks.gpu_fit_to_end --accelerator cpu --model debug --sequence-length 64   # the checks, on a CPU

The run trains ``--steps`` steps of the quickstart (its model, or ``--model``) on random tokens, in monitor windows
of 5 steps, with no checkpoint before the end. Then: the fit exited 0; the final checkpoint holds the last step;
TensorBoard holds every series the monitor logs on this device (app/observability/fields.py) with a point per window,
the CUDA memory ones above 0, and the layout charts them; the run summary was printed with its memory lines. One row
per check, held, failed (with what was seen) or skipped (why: on a CPU, the CUDA ones), printed and appended to
``--table`` (tab-separated); exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

from app.observability.fields import WindowField, logged_fields
from benchmarks.gpu_throughput import REPO_ROOT, write_random_tokens

WINDOW = 5  # optimizer steps per monitor window
STATISTICS = ("rank0", "min", "median", "max")

Row = tuple[str, str, str]  # (check, held | failed | skipped, detail)


def fit(run_dir: Path, data_dir: Path, args: argparse.Namespace) -> subprocess.CompletedProcess:
    steps = args.steps
    presets = ["-c", str(REPO_ROOT / "configs" / "trainer" / "gpu_bf16.yaml")] if args.accelerator == "gpu" else []
    command = [sys.executable, "-m", "app", "fit", "-c", str(REPO_ROOT / "configs" / "quickstart.yaml"), *presets,
               "--trainer.accelerator", args.accelerator, "--trainer.max_steps", str(steps),
               "--trainer.log_every_n_steps", str(WINDOW), "--monitor.every_n_steps", str(WINDOW),
               "--val_every_n_steps", str(steps), "--checkpoint.every_n_train_steps", str(10 * steps),
               "--model.model_name", args.model, "--model.max_new_tokens", "20", "--data.data_dir", str(data_dir),
               "--data.sequence_length", str(args.sequence_length), "--data.val_samples", "32"]
    return subprocess.run(command, cwd=run_dir, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def check_checkpoint(run_dir: Path, steps: int) -> Row:
    path = run_dir / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    if not path.exists():
        return "final checkpoint", "failed", f"no {path.relative_to(run_dir)}"
    step = torch.load(path, map_location="cpu", weights_only=False)["global_step"]
    return "final checkpoint", "held" if step == steps else "failed", f"last.ckpt at step {step} of {steps}"


def check_series(events: EventAccumulator, fields: tuple[WindowField, ...], windows: int, cuda: bool) -> list[Row]:
    tags = set(events.Tags()["scalars"])
    missing = [field.tag(s) for field in fields for s in STATISTICS if field.tag(s) not in tags]
    short = [field.tag(s) for field in fields for s in STATISTICS
             if field.tag(s) in tags and len(events.Scalars(field.tag(s))) != windows]
    rows = [("monitor series in TensorBoard", "failed" if missing or short else "held",
             f"missing {missing[:3]}, without {windows} points {short[:3]}" if missing or short
             else f"{len(fields)} fields x {len(STATISTICS)} tags, {windows} windows")]
    cuda_fields = [field for field in fields if field.cuda_only]
    if not cuda:
        return [*rows, ("CUDA memory above 0", "skipped", "not a GPU run")]
    peaks = {field.name: min(event.value for event in events.Scalars(field.tag("max")))
             for field in cuda_fields if field.tag("max") in tags}
    held = len(peaks) == len(cuda_fields) and all(peak > 0 for peak in peaks.values())
    return [*rows, ("CUDA memory above 0", "held" if held else "failed",
                    ", ".join(f"{name} {peak:.2f} GiB" for name, peak in peaks.items()) or "no CUDA series")]


def check_layout(events: EventAccumulator, fields: tuple[WindowField, ...], cuda: bool) -> Row:
    if not cuda:
        return "CUDA charts in the layout", "skipped", "not a GPU run"
    if "custom_scalars__config__" not in events.Tags()["tensors"]:
        return "CUDA charts in the layout", "failed", "no layout in the event file"
    config = events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    titles = {chart.title for category in layout_pb2.Layout.FromString(config).category for chart in category.chart}
    missing = [field.chart for field in fields if field.cuda_only and f"{field.chart} — every rank" not in titles]
    return "CUDA charts in the layout", "failed" if missing else "held", f"missing {missing}" if missing else "all"


def check_summary(console: str, fields: tuple[WindowField, ...]) -> Row:
    missing = [field.summary for field in fields if field.summary and field.summary not in console]
    if "run summary (" not in console or missing:
        return "run summary", "failed", f"no summary or no line for {missing}"
    memory = [" ".join(line.split()) for line in console.splitlines() if "largest rank" in line]
    return "run summary", "held", "; ".join(memory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--model", default="small", help="a GPT size of models/gpt/network.py")
    parser.add_argument("--sequence-length", type=int, default=128, help="at most the model's block size")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--table", type=Path, help="append the rows here, tab-separated")
    args = parser.parse_args()
    cuda = args.accelerator == "gpu"
    fields = logged_fields(cuda, pipeline=False)
    with tempfile.TemporaryDirectory() as temporary:
        data_dir, run_dir = Path(temporary) / "data", Path(temporary) / "run"
        data_dir.mkdir()
        run_dir.mkdir()
        write_random_tokens(data_dir, 32 * (args.sequence_length + 1) * (args.steps + 10), vocab_size=256)
        completed = fit(run_dir, data_dir, args)
        console = completed.stdout + completed.stderr
        rows: list[Row] = [("fit to its end", "held" if completed.returncode == 0 else "failed",
                            f"exit {completed.returncode}" + ("" if completed.returncode == 0
                                                              else f": {console.strip().splitlines()[-1]}"))]
        rows.append(check_checkpoint(run_dir, args.steps))
        events = EventAccumulator(str(run_dir / "lightning_logs" / "version_0"), size_guidance={"scalars": 0,
                                                                                                 "tensors": 0})
        events.Reload()
        rows += check_series(events, fields, args.steps // WINDOW, cuda)
        rows.append(check_layout(events, fields, cuda))
        rows.append(check_summary(console, fields))
    for check, result, detail in rows:
        print(f"{check:32} {result:8} {detail}")
    if args.table:
        with args.table.open("a") as table:
            table.writelines(f"fit on {args.accelerator}: {check}\t{result}\t{detail}\n"
                             for check, result, detail in rows)
    sys.exit(1 if any(result == "failed" for _, result, _ in rows) else 0)


if __name__ == "__main__":
    main()
