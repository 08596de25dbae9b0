"""Per-optimizer-step time of ``cohort fit`` (LightningCLI) against a hand-written PyTorch loop doing the same work.

    . .venv/bin/activate
    python -m benchmarks.lightning_overhead --model small --steps 40 --warmup-steps 5 --repeats 3

Both sides run as fresh subprocesses with the same torch thread count, interleaved (P L, L P, P L, ...), on the
same corpus (100 stdlib files, byte-level), the same model, initial weights, sample order, AdamW parameter
groups, LR schedule, gradient clipping and accumulation, fp32 on 1 CPU process. Only optimizer steps after
``--warmup-steps`` are timed, so startup, the first slow steps and the final checkpoint are excluded. The
per-micro-batch losses of both sides are compared to show that the work is the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

REPO_ROOT = Path(__file__).resolve().parent.parent
CORPUS_FILES = 100  # stdlib files in the benchmark corpus: about 13k windows of 128 tokens
QUIET_LOAD = 0.2  # a step counts as quiet when other processes used less than this many cores during it


def cpu_sample() -> list[float]:
    """[wall clock, this process's CPU seconds, CPU seconds the whole machine has been busy (steal included)].

    The machine is shared (2 cores), so each step records how much CPU other processes took meanwhile; steps
    that competed with them are reported apart. Linux only (/proc/stat).
    """
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return [time.perf_counter(), time.process_time(), busy]


class StepTimer(Callback):
    """Writes a wall-clock and CPU-time sample (``cpu_sample``) per optimizer step and every micro-batch's loss to a JSON file.

    Loaded by the CLI with ``--trainer.callbacks+=benchmarks.lightning_overhead.StepTimer
    --trainer.callbacks.path=FILE``.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.samples: list[list[float]] = []
        self.losses: list[float] = []
        self._last_step = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning hands back the loss divided by the accumulation; undo that the way the plain loop does it
        self.losses.append(outputs["loss"].item() * trainer.accumulate_grad_batches)
        if trainer.global_step != self._last_step:  # an optimizer step (and the LR scheduler step) just happened
            self.samples.append(cpu_sample())
            self._last_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        result = {
            "samples": self.samples,
            "losses": self.losses,
            "threads": torch.get_num_threads(),
            "callbacks": [type(callback).__name__ for callback in trainer.callbacks],
            "logger": type(trainer.logger).__name__ if trainer.logger else None,
        }
        Path(self.path).write_text(json.dumps(result))


def run_plain(args: argparse.Namespace) -> dict[str, Any]:
    """The hand-written loop: what ``cohort fit`` does per step, with nothing around it."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from datamodules.samplers import GlobalBatchSampler
    from datamodules.token_files import IGNORE_INDEX, TokenWindows
    from models.gpt import GPT, gpt_config
    from models.language_model import warmup_cosine_schedule

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # what seed_everything does before the CLI builds the model
    model = GPT(gpt_config(args.model, vocab_size=256, dropout=0.0))
    model.train()
    dataset = TokenWindows(Path(args.data_dir) / "train.bin", args.sequence_length, 256)
    sampler = GlobalBatchSampler(len(dataset), args.global_batch_size, args.micro_batch_size, rank=0, world_size=1,
                                 seed=args.seed)
    loader = DataLoader(dataset, sampler=sampler, batch_size=args.micro_batch_size, num_workers=0)
    # the parameter groups of GPTLanguageModel.configure_optimizers: no decay on biases, norms and embeddings
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
    no_decay = [p for p in params if p.dim() < 2 or id(p) in embeddings]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.learning_rate, betas=(0.9, 0.95), fused=True)
    total_steps = args.warmup_steps + args.steps  # = trainer.max_steps = estimated_stepping_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine_schedule(args.lr_warmup_steps, total_steps, 0.1))
    clipped = [p for group in optimizer.param_groups for p in group["params"]]  # Lightning clips in this order
    accumulation = args.global_batch_size // args.micro_batch_size

    samples: list[list[float]] = []
    losses: list[float] = []
    batches = iter(loader)
    for _ in range(total_steps):
        for _ in range(accumulation):
            inputs, targets = next(batches)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
            scaled = loss / accumulation  # as Lightning's closure scales it
            scaled.backward()
            losses.append(scaled.item() * accumulation)
        torch.nn.utils.clip_grad_norm_(clipped, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        samples.append(cpu_sample())
    return {"samples": samples, "losses": losses, "threads": torch.get_num_threads()}


def lightning_command(args: argparse.Namespace, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "app", "fit",
        "--seed_everything", str(args.seed),
        "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "32-true",
        "--trainer.max_steps", str(args.warmup_steps + args.steps),
        "--trainer.gradient_clip_val", "1.0",
        "--trainer.limit_val_batches", "0",  # no validation
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.log_every_n_steps", str(args.log_every_n_steps),  # TensorBoard logger stays on: it is the product
        "--checkpoint.every_n_train_steps", "1000000",  # only the final last.ckpt, written after the timed steps
        "--model.model_name", args.model, "--model.dropout", "0.0",
        "--model.learning_rate", str(args.learning_rate), "--model.weight_decay", str(args.weight_decay),
        "--model.warmup_steps", str(args.lr_warmup_steps),
        "--data.data_dir", args.data_dir, "--data.sequence_length", str(args.sequence_length),
        "--data.global_batch_size", str(args.global_batch_size), "--data.micro_batch_size", str(args.micro_batch_size),
        "--data.num_workers", "0",
        "--trainer.callbacks+=benchmarks.lightning_overhead.StepTimer", f"--trainer.callbacks.path={out}",
    ]


def run_once(kind: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True)
    out = run_dir / "steps.json"
    if kind == "lightning":
        command = lightning_command(args, out)
    else:
        command = [sys.executable, "-m", "benchmarks.lightning_overhead", *args.argv, "--threads", str(args.threads),
                   "--worker", "plain", "--out", str(out), "--data-dir", args.data_dir]
    # the same environment for both: torch's intra-op threads fixed, the repo importable, warnings off
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{kind} run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def timed_steps(result: dict[str, Any], warmup: int) -> list[tuple[float, float]]:
    """(seconds, cores used by other processes) of each optimizer step after the warmup, from consecutive
    end-of-step samples."""
    samples = result["samples"][warmup - 1:]
    return [(t1 - t0, max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0))
            for (t0, own0, busy0), (t1, own1, busy1) in zip(samples, samples[1:])]


def median_time(runs: list[dict[str, Any]], warmup: int, quiet: bool) -> tuple[float, int]:
    """Median step time over all runs' timed steps (only the quiet ones if asked) and how many steps that is."""
    times = [t for run in runs for t, load in timed_steps(run, warmup) if not quiet or load < QUIET_LOAD]
    return (statistics.median(times) if times else float("nan")), len(times)


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    accumulation = args.global_batch_size // args.micro_batch_size
    print(f"\nmodel {args.model}, global batch {args.global_batch_size} = micro {args.micro_batch_size} x "
          f"{accumulation} accumulation, sequence {args.sequence_length}, {args.steps} timed steps after "
          f"{args.warmup_steps} warmup steps, {args.repeats} repeats, {results['plain'][0]['threads']} torch threads")
    print(f"lightning callbacks: {', '.join(results['lightning'][0]['callbacks'])}; "
          f"logger: {results['lightning'][0]['logger']} every {args.log_every_n_steps} steps")
    print("\nloss per micro-batch (first 3 optimizer steps):")
    plain_losses, lightning_losses = results["plain"][0]["losses"], results["lightning"][0]["losses"]
    for i in range(min(3 * accumulation, len(plain_losses))):
        print(f"  step {i // accumulation} micro {i % accumulation}: plain {plain_losses[i]:.8f}  "
              f"lightning {lightning_losses[i]:.8f}  diff {abs(plain_losses[i] - lightning_losses[i]):.2e}")
    worst = max(abs(a - b) for run in results["plain"] + results["lightning"]
                for a, b in zip(plain_losses, run["losses"], strict=True))
    print(f"  max |loss difference| over all {len(plain_losses)} micro-batches and all runs: {worst:.2e}")

    print(f"\n{'':10}{'median s/step':>14}{'quiet steps':>12}{'all steps':>10}   per-repeat: median s/step "
          f"(other processes' mean load, cores)")
    medians = {}
    for kind, runs in results.items():
        medians[kind], quiet_count = median_time(runs, args.warmup_steps, quiet=True)
        all_median, all_count = median_time(runs, args.warmup_steps, quiet=False)
        per_repeat = "  ".join(
            f"{statistics.median(t for t, _ in steps):.4f} ({statistics.mean(load for _, load in steps):.2f})"
            for steps in (timed_steps(run, args.warmup_steps) for run in runs))
        print(f"{kind:10}{medians[kind]:14.4f}{quiet_count:>12}{all_median:10.4f}   {per_repeat}")
    ratio = medians["lightning"] / medians["plain"]
    bar = medians["plain"] * 1.01 + 0.1
    overhead_ms = (medians["lightning"] - medians["plain"]) * 1000
    print(f"(median s/step: over quiet steps, where other processes used < {QUIET_LOAD} cores; all steps: over all)")
    print(f"\nratio lightning/plain: {ratio:.4f} (goal <= 1.02: {'met' if ratio <= 1.02 else 'NOT met'}); "
          f"overhead {overhead_ms:+.1f} ms/step")
    print(f"Lightning parity bar (plain x 1.01 + 0.1 s = {bar:.4f} s/step): "
          f"{'passed' if medians['lightning'] <= bar else 'FAILED'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="a name from models.gpt.GPT_CONFIGS")
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed optimizer steps at the start of a run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side, alternating which goes first")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads on both sides")
    parser.add_argument("--seed", type=int, default=1337, help="the app's default seed_everything")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--lr-warmup-steps", type=int, default=10, help="the LR schedule's linear warmup")
    parser.add_argument("--log-every-n-steps", type=int, default=10, help="Lightning's logging cadence")
    parser.add_argument("--worker", choices=["plain"], help=argparse.SUPPRESS)  # internal: run one side
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # the plain-loop worker gets the same options
    if args.worker == "plain":
        Path(args.out).write_text(json.dumps(run_plain(args)))
        return
    if args.warmup_steps < 1 or args.global_batch_size % args.micro_batch_size:
        sys.exit("--warmup-steps must be >= 1 and --global-batch-size a multiple of --micro-batch-size")
    sys.path.insert(0, str(REPO_ROOT))
    from datamodules.prepare import prepare_byte_corpus, stdlib_source_files

    with tempfile.TemporaryDirectory(prefix="lightning_overhead_") as tmp:
        args.data_dir = str(Path(tmp) / "corpus")
        train_tokens, _ = prepare_byte_corpus(stdlib_source_files()[:CORPUS_FILES], Path(args.data_dir))
        steps_per_epoch = (train_tokens - 1) // args.sequence_length // args.global_batch_size
        if args.warmup_steps + args.steps > steps_per_epoch:  # an epoch boundary would add work to one step
            sys.exit(f"at most {steps_per_epoch} steps fit in one epoch of the benchmark corpus")
        results: dict[str, list[dict[str, Any]]] = {"plain": [], "lightning": []}
        for repeat in range(args.repeats):
            order = ("plain", "lightning") if repeat % 2 == 0 else ("lightning", "plain")
            for kind in order:
                results[kind].append(run_once(kind, args, Path(tmp) / f"{kind}_{repeat}"))
                print(f"repeat {repeat} {kind}: {results[kind][-1]['wall_s']:.1f} s", flush=True)
        report(args, results)


if __name__ == "__main__":
    main()
