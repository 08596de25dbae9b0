"""Per-optimizer-step time of ``cohort fit`` (LightningCLI) against a hand-written PyTorch loop doing the same work.

    . .venv/bin/activate
    python -m benchmarks.lightning_overhead --model small --steps 40 --warmup-steps 5 --repeats 4

Each repeat starts both sides as subprocesses (``python -m app fit ...`` and this module's plain loop) with the
same torch thread count and runs them in lockstep, one optimizer step at a time (P L P L ..., or L P L P ... in
odd repeats): the host's slow drifts in speed then hit both sides alike. A step is timed from the moment its side
gets the turn to the end of its optimizer step, so waiting, startup and the final checkpoint are not counted, and
the first ``--warmup-steps`` steps are dropped. Same work on both sides: the same corpus (100 stdlib files,
byte-level), model, initial weights, sample order, AdamW groups, LR schedule, clipping and accumulation, fp32 on
one CPU process (``--accelerator gpu``: bf16-mixed on one GPU, each step timed until the device is done); the
per-micro-batch losses of both sides are printed and compared.
"""

from __future__ import annotations

import argparse
import json
import os
import select
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
QUIET_LOAD = 0.2  # a step is "quiet" when other processes used less than this many cores during it
KINDS = ("plain", "lightning")
SEED = 1337  # the app's DEFAULT_SEED: seed_everything before the model is built, and the sampler's seed
PRECISION = {"cpu": "32-true", "gpu": "bf16-mixed"}  # what each side trains in, by accelerator
LEARNING_RATE, WEIGHT_DECAY, LR_WARMUP_STEPS = 3e-3, 0.1, 10  # as in configs/quickstart.yaml (shorter warmup)


def cpu_sample() -> list[float]:
    """[wall clock s, this process's CPU s, CPU s the whole machine has been busy (steal included)]: on a shared
    machine, every step records how much CPU other processes took meanwhile (Linux only)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return [time.perf_counter(), time.process_time(), busy]


class Turns:
    """One side of the lockstep: ``step_done`` tells the parent that a step has ended and blocks until the parent
    gives this side the next turn. Keeps a [start, end] ``cpu_sample`` pair per step."""

    def __init__(self, folder: str) -> None:
        self.done = open(Path(folder) / "done", "wb", buffering=0)  # FIFOs made by the parent
        self.go = open(Path(folder) / "go", "rb", buffering=0)
        self.steps: list[list[list[float]]] = []
        self.start: list[float] | None = None

    def step_done(self) -> None:
        if self.start is not None:
            self.steps.append([self.start, cpu_sample()])
        self.done.write(b".")
        self.go.read(1)
        self.start = cpu_sample()


class StepTimer(Callback):
    """The Lightning side: ``--trainer.callbacks+=benchmarks.lightning_overhead.StepTimer
    --trainer.callbacks.path=FILE --trainer.callbacks.turns=FOLDER``; writes step times and losses to FILE."""

    def __init__(self, path: str, turns: str) -> None:
        self.path, self.turns_folder = path, turns
        self.losses: list[float] = []
        self._last_step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.turns = Turns(self.turns_folder)
        self.turns.step_done()  # wait for the first turn

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning hands back the loss divided by the accumulation; undo that the way the plain loop does it
        self.losses.append(outputs["loss"].item() * trainer.accumulate_grad_batches)
        if trainer.global_step != self._last_step:  # an optimizer step (and the LR scheduler's) just happened
            self._last_step = trainer.global_step
            if pl_module.device.type == "cuda":  # the step ends when the device is done with it
                torch.cuda.synchronize()
            self.turns.step_done()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        Path(self.path).write_text(json.dumps({
            "steps": self.turns.steps, "losses": self.losses, "threads": torch.get_num_threads(),
            "callbacks": [type(callback).__name__ for callback in trainer.callbacks],
            "logger": type(trainer.logger).__name__ if trainer.logger else None,
        }))


def run_plain(args: argparse.Namespace) -> dict[str, Any]:
    """The hand-written loop: what ``cohort fit`` computes per step, with nothing around it."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from core.precision import PRECISIONS
    from core.run_plan import RunPlan
    from core.tokens import IGNORE_INDEX
    from datamodules.samplers import GlobalBatchSampler
    from datamodules.token_files import TokenWindows
    from models.gpt.network import gpt_config
    from models.gpt.family import build_gpt
    from models.optimizer import warmup_cosine_schedule, weight_decay_groups

    # what GPTLanguageModel.configure_model builds: the same weights from the same seed
    device = torch.device("cuda" if args.accelerator == "gpu" else "cpu")
    model = build_gpt(gpt_config(args.model, vocab_size=256, dropout=0.0), device, seed=SEED)
    # bf16-mixed on a GPU: matrix products in bfloat16 under autocast, as Lightning's MixedPrecision runs them
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    model.train()
    dataset = TokenWindows(Path(args.data_dir) / "train.bin", args.sequence_length, 256)
    plan = RunPlan(devices_per_node=1, num_nodes=1, data_parallel_size=1, tensor_parallel_size=1,
                   global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                   sequence_length=args.sequence_length,
                   precision=PRECISIONS[PRECISION[args.accelerator]], seed=SEED)  # as the CLI resolves it
    sampler = GlobalBatchSampler(len(dataset), plan, data_parallel_rank=0)
    loader = DataLoader(dataset, sampler=sampler, batch_size=args.micro_batch_size, num_workers=0)
    # the two groups of GPTLanguageModel.configure_optimizers (no decay on biases, norms and embeddings), fused
    optimizer = torch.optim.AdamW(weight_decay_groups(model, WEIGHT_DECAY), lr=LEARNING_RATE, betas=(0.9, 0.95),
                                  fused=True)
    total_steps = args.warmup_steps + args.steps  # = trainer.max_steps = estimated_stepping_batches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine_schedule(LR_WARMUP_STEPS, total_steps, 0.1))
    clipped = [p for group in optimizer.param_groups for p in group["params"]]  # Lightning clips in this order
    accumulation = plan.accumulation

    losses: list[float] = []
    batches = iter(loader)
    turns = Turns(args.turns)
    turns.step_done()  # wait for the first turn
    for _ in range(total_steps):
        for _ in range(accumulation):
            inputs, targets = (tensor.to(device) for tensor in next(batches))
            with autocast:
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
            scaled = loss / accumulation  # as Lightning's closure scales it
            scaled.backward()
            losses.append(scaled.item() * accumulation)
        torch.nn.utils.clip_grad_norm_(clipped, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        turns.step_done()
    return {"steps": turns.steps, "losses": losses, "threads": torch.get_num_threads()}


def command(kind: str, args: argparse.Namespace, folder: Path) -> list[str]:
    out, python = folder / "result.json", sys.executable
    if kind == "plain":
        return [python, "-m", "benchmarks.lightning_overhead", *args.argv, "--threads", str(args.threads),
                "--worker", str(folder), "--data-dir", args.data_dir]
    return [
        python, "-m", "app", "fit", "--seed_everything", str(SEED),
        "--trainer.accelerator", args.accelerator, "--trainer.devices", "1",
        "--trainer.precision", PRECISION[args.accelerator],
        "--trainer.max_steps", str(args.warmup_steps + args.steps), "--trainer.gradient_clip_val", "1.0",
        "--trainer.limit_val_batches", "0",  # no validation
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.log_every_n_steps", str(args.log_every_n_steps),  # TensorBoard logger stays on: it is the product
        "--checkpoint.every_n_train_steps", "1000000",  # only the final last.ckpt, after the timed steps
        "--model.model_name", args.model, "--model.dropout", "0.0", "--model.optimizer.learning_rate", str(LEARNING_RATE),
        "--model.optimizer.weight_decay", str(WEIGHT_DECAY), "--model.optimizer.warmup_steps", str(LR_WARMUP_STEPS),
        "--data.data_dir", args.data_dir, "--data.sequence_length", str(args.sequence_length),
        "--data.global_batch_size", str(args.global_batch_size), "--data.micro_batch_size", str(args.micro_batch_size),
        "--data.num_workers", "0", "--trainer.callbacks+=benchmarks.lightning_overhead.StepTimer",
        f"--trainer.callbacks.path={out}", f"--trainer.callbacks.turns={folder}",
    ]


def run_pair(args: argparse.Namespace, folder: Path, order: tuple[str, str]) -> dict[str, dict[str, Any]]:
    """Start both sides, then hand out turns: one optimizer step each, in ``order``, until both are done."""
    # the same environment for both: torch's intra-op threads fixed, the repo importable, warnings off
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path, "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    procs, go, done = {}, {}, {}
    for kind in KINDS:
        (folder / kind).mkdir(parents=True)
        for name, fds in (("go", go), ("done", done)):
            os.mkfifo(folder / kind / name)
            fds[kind] = os.open(folder / kind / name, os.O_RDWR)  # read-write: opening never blocks
        with open(folder / kind / "log.txt", "w") as log:
            procs[kind] = subprocess.Popen(command(kind, args, folder / kind), cwd=folder / kind, env=env,
                                           stdout=log, stderr=subprocess.STDOUT)

    def fail(kind: str) -> None:
        sys.exit(f"{kind} run failed ({procs[kind].returncode}):\n{(folder / kind / 'log.txt').read_text()[-4000:]}")

    def wait_done(kind: str) -> None:
        while not select.select([done[kind]], [], [], 1.0)[0]:
            if procs[kind].poll() is not None:  # it died instead of finishing its step
                fail(kind)
        os.read(done[kind], 1)

    for kind in KINDS:
        wait_done(kind)  # both started up and wait before their first step
    for _ in range(args.warmup_steps + args.steps):
        for kind in order:
            os.write(go[kind], b".")
            wait_done(kind)
    results = {}
    for kind in KINDS:
        os.write(go[kind], b".")  # let both finish
        if procs[kind].wait() != 0:
            fail(kind)
        results[kind] = json.loads((folder / kind / "result.json").read_text())
    return results


def timed_steps(run: dict[str, Any], warmup: int) -> list[tuple[float, bool]]:
    """(seconds, quiet) of each step after the warmup; quiet: other processes used less than QUIET_LOAD cores
    meanwhile (or under two clock ticks of CPU, the resolution of /proc/stat, for very short steps)."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    return [(t1 - t0, (busy1 - busy0) - (own1 - own0) < max(QUIET_LOAD * (t1 - t0), 2 * tick))
            for (t0, own0, busy0), (t1, own1, busy1) in run["steps"][warmup:]]


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> None:
    accumulation = args.global_batch_size // args.micro_batch_size  # one process
    lightning = results["lightning"][0]
    print(f"\nmodel {args.model}, global batch {args.global_batch_size} = micro {args.micro_batch_size} x "
          f"{accumulation} accumulation, sequence {args.sequence_length}, {args.steps} timed steps after "
          f"{args.warmup_steps} warmup steps, {args.repeats} repeats, {lightning['threads']} torch threads\n"
          f"lightning callbacks: {', '.join(lightning['callbacks'])}; logger: {lightning['logger']} every "
          f"{args.log_every_n_steps} steps\n\nloss per micro-batch (first 3 optimizer steps):")
    plain_losses = results["plain"][0]["losses"]
    for i in range(min(3 * accumulation, len(plain_losses))):
        print(f"  step {i // accumulation} micro {i % accumulation}: plain {plain_losses[i]:.8f}  "
              f"lightning {lightning['losses'][i]:.8f}  diff {abs(plain_losses[i] - lightning['losses'][i]):.2e}")
    worst = max(abs(a - b) for run in results["plain"] + results["lightning"]
                for a, b in zip(plain_losses, run["losses"], strict=True))
    print(f"  max |loss difference| over all {len(plain_losses)} micro-batches and all runs: {worst:.2e}\n")

    steps = {kind: [timed_steps(run, args.warmup_steps) for run in runs] for kind, runs in results.items()}
    medians = {}
    for kind, runs in steps.items():
        every = [t for run in runs for t, _ in run]
        quiet = [t for run in runs for t, calm in run if calm]
        medians[kind] = statistics.median(quiet or every)
        per_repeat = " ".join(f"{statistics.median(t for t, _ in run):.4f}" for run in runs)
        over = f"over {len(quiet)} quiet steps" if quiet else "over all steps: NONE was quiet, so this is not a measurement"
        print(f"{kind:>9}: median {medians[kind]:.4f} s/step {over} "
              f"({statistics.median(every):.4f} over all {len(every)}); per repeat: {per_repeat}")
    # the two sides' k-th steps ran back to back, so their ratio and difference cancel the host's slow drifts
    every_pair = [(lt, pt, p_calm and l_calm) for plain, lightning in zip(steps["plain"], steps["lightning"])
                  for (pt, p_calm), (lt, l_calm) in zip(plain, lightning)]
    pairs = [(lt, pt) for lt, pt, calm in every_pair if calm] or [(lt, pt) for lt, pt, _ in every_pair]
    if not all(any(calm for run in runs for _, calm in run) for runs in steps.values()):
        print("other processes used the CPU during every step of a side: run again on an idle machine")
    ratio = medians["lightning"] / medians["plain"]
    bar = medians["plain"] * 1.01 + 0.1
    print(f"(quiet: other processes used < {QUIET_LOAD} cores during the step)\n\n"
          f"ratio lightning/plain of the medians: {ratio:.4f} (goal <= 1.02: {'met' if ratio <= 1.02 else 'NOT met'})"
          f", difference {(medians['lightning'] - medians['plain']) * 1000:+.1f} ms/step\n"
          f"{len(pairs)} quiet step pairs: median ratio {statistics.median(lt / pt for lt, pt in pairs):.4f}, "
          f"median difference {statistics.median(lt - pt for lt, pt in pairs) * 1000:+.1f} ms/step\n"
          f"Lightning parity bar (plain x 1.01 + 0.1 s = {bar:.4f} s/step): "
          f"{'passed' if medians['lightning'] <= bar else 'FAILED'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="a name from models.gpt.network.GPT_CONFIGS")
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps per run")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed optimizer steps at the start of a run")
    parser.add_argument("--repeats", type=int, default=4, help="pairs of runs, alternating which side goes first")
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--accelerator", choices=sorted(PRECISION), default="cpu",
                        help="cpu (32-true) or gpu (bf16-mixed, one device; each step ends when the device is done)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads on both sides")
    parser.add_argument("--log-every-n-steps", type=int, default=10, help="Lightning's logging cadence")
    parser.add_argument("--save-json", type=Path, help="also write every run's raw step samples and losses here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run the plain loop, turns in this folder
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        args.turns = args.worker
        (Path(args.worker) / "result.json").write_text(json.dumps(run_plain(args)))
        return
    args.argv = sys.argv[1:] if argv is None else argv  # the plain worker gets the same options
    if args.warmup_steps < 1 or args.global_batch_size % args.micro_batch_size:
        sys.exit("--warmup-steps must be >= 1 and --global-batch-size a multiple of --micro-batch-size")
    sys.path.insert(0, str(REPO_ROOT))
    from datamodules.prepare import prepare_corpus, stdlib_source_files

    with tempfile.TemporaryDirectory(prefix="lightning_overhead_") as tmp:
        args.data_dir = str(Path(tmp) / "corpus")
        train_tokens, _ = prepare_corpus(stdlib_source_files()[:CORPUS_FILES], Path(args.data_dir))
        steps_per_epoch = (train_tokens - 1) // args.sequence_length // args.global_batch_size
        if args.warmup_steps + args.steps > steps_per_epoch:  # an epoch boundary would add work to one step
            sys.exit(f"at most {steps_per_epoch} steps fit in one epoch of the benchmark corpus")
        results: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
        for repeat in range(args.repeats):
            order = KINDS if repeat % 2 == 0 else KINDS[::-1]
            started = time.perf_counter()
            for kind, result in run_pair(args, Path(tmp) / f"repeat_{repeat}", order).items():
                results[kind].append(result)
            print(f"repeat {repeat} ({' '.join(order)}): {time.perf_counter() - started:.1f} s", flush=True)
        report(args, results)
        if args.save_json:
            args.save_json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **results}))


if __name__ == "__main__":
    main()
