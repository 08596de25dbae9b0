"""Training throughput and MFU of ``cohort fit`` on one device: one process, then ``fsdp`` and ``model_parallel``.

    python -m benchmarks.gpu_throughput                       # gpt2 124M, bf16-mixed, compile, block 1024, 1 GPU
    python -m benchmarks.gpu_throughput --accelerator cpu --model debug --sequence-length 64 --micro-batch-size 8 \\
        --precision 32-true --no-compile --steps 20 --strategies single model_parallel   # checks the script itself

The data are random GPT-2 token ids written to a temporary folder (throughput does not depend on what the
tokens say). Each run trains ``--steps`` optimizer steps with the monitor on; tokens/s and MFU are the medians
of its TensorBoard windows after the first (which holds compilation and warm-up). MFU is against the dense
peak of app/observability/flops.py (989 TFLOP/s bf16 for H100 and H200). Issue #3's goal: MFU >= 50% for the single run;
the sharded runs on one device are a sanity check (same work, plus their bookkeeping).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.observability.fields import CUDA_PEAK_ALLOCATED

REPO_ROOT = Path(__file__).resolve().parent.parent
TRAINER = REPO_ROOT / "configs" / "trainer"
PRESETS = {
    "single": ["-c", str(TRAINER / "gpu_bf16.yaml")],
    "fsdp": ["-c", str(TRAINER / "fsdp_gpu_bf16.yaml"), "--trainer.devices", "1"],
    "model_parallel": ["-c", str(TRAINER / "model_parallel_gpu_bf16.yaml"), "--trainer.devices", "1",
                       "--trainer.strategy.init_args.data_parallel_size", "1"],
}


def write_random_tokens(folder: Path, tokens: int, vocab_size: int) -> None:
    generator = np.random.default_rng(0)
    for split, count in (("train", tokens), ("val", tokens // 10)):
        generator.integers(0, vocab_size, count, dtype=np.uint16).tofile(folder / f"{split}.bin")


def window_medians(log_dir: Path) -> dict[str, float]:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    medians = {}
    for tag in ("throughput/tokens_per_second", "throughput/mfu", CUDA_PEAK_ALLOCATED.tag("max")):
        if tag in events.Tags()["scalars"]:
            values = [event.value for event in events.Scalars(tag)]
            medians[tag] = statistics.median(values[1:] if len(values) > 1 else values)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--strategies", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    parser.add_argument("--save-json", type=Path)
    args = parser.parse_args()
    vocab_size = 50257 if args.model.startswith("gpt") else 256
    results = {}
    with tempfile.TemporaryDirectory() as temporary:
        data_dir = Path(temporary) / "data"
        data_dir.mkdir()
        write_random_tokens(data_dir, args.micro_batch_size * (args.sequence_length + 1) * (args.steps + 10), vocab_size)
        for strategy in args.strategies:
            run_dir = Path(temporary) / strategy
            run_dir.mkdir()
            command = [
                sys.executable, "-m", "app", "fit", *PRESETS[strategy],
                "--trainer.accelerator", args.accelerator, "--trainer.precision", args.precision,
                "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
                "--trainer.log_every_n_steps", "10", "--trainer.enable_progress_bar", "false",
                "--checkpoint.every_n_train_steps", "1000000000",
                "--model.model_name", args.model, "--model.compile", str(not args.no_compile).lower(),
                "--data.data_dir", str(data_dir), "--data.vocab_size", str(vocab_size),
                "--data.sequence_length", str(args.sequence_length),
                "--data.global_batch_size", str(args.micro_batch_size),
                "--data.micro_batch_size", str(args.micro_batch_size),
            ]
            completed = subprocess.run(command, cwd=run_dir, capture_output=True, text=True,
                                       env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
            if completed.returncode != 0:
                sys.exit(f"{strategy} failed:\n{completed.stderr[-3000:]}")
            results[strategy] = window_medians(run_dir / "lightning_logs" / "version_0")
    print(f"{args.model}, {args.precision}, compile {not args.no_compile}, {args.micro_batch_size} x "
          f"{args.sequence_length} tokens per step, {args.steps} steps, medians of the windows after the first")
    for strategy, numbers in results.items():
        mfu = numbers.get("throughput/mfu")
        memory = numbers.get(CUDA_PEAK_ALLOCATED.tag("max"))
        print(f"  {strategy:15} {numbers['throughput/tokens_per_second']:12,.0f} tokens/s   MFU "
              f"{f'{mfu:.1%}' if mfu is not None else 'n/a'}   CUDA peak "
              f"{f'{memory:.1f} GiB' if memory is not None else 'n/a (not logged)'}")
    if args.save_json:
        args.save_json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
