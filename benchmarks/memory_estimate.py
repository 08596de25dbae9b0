"""app/memory.py's estimate against the measured peak memory of real training steps, one fresh process per row.

    python -m benchmarks.memory_estimate               # every row; about 5 minutes on 2 idle CPU cores
    python -m benchmarks.memory_estimate --rows 0 4    # some of them
    python -m benchmarks.memory_estimate --device cuda # on a GPU: CUDA peaks instead (not run yet: no GPU lent)

Each row builds a GPT as the app does (models/parallelize.py, seed 1337) in a new Python process, then runs two
optimizer steps of ``accumulation`` micro-batches each (forward under autocast for mixed precision, cross-entropy,
backward; fused AdamW with the app's weight-decay groups; gradients set to None after each step, as Lightning
does). The second step is the steady state: the optimizer's moments exist from its first micro-batch on.

How the peak is measured:
- CPU: the process's peak resident memory (VmHWM in /proc/self/status) minus its resident memory after imports
  and a small warm-up step (thread pools, kernels), taken before the model is built. torch's CPU allocator keeps
  no statistics (``torch.cuda.memory_stats`` is GPU only, and the profiler's ``profile_memory`` records each
  allocation at a cost that would dominate these steps), and it caches nothing, so the high-water mark of the
  process is the peak of live tensors plus malloc's slack. That slack is kept small by MALLOC_MMAP_THRESHOLD_=65536
  in the child's environment: every block above 64 KiB gets its own mapping, returned to the system when freed,
  instead of glibc's default that moves the threshold up after each large free and leaves freed tensors in the heap.
- CUDA: ``torch.cuda.max_memory_allocated`` over the steps, from an empty device. The estimate is compared
  without its allowances (CUDA context, fragmentation), which that counter does not see.

Models are big enough (tens to hundreds of MB of state) that the interpreter's noise (a few MB) is small.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from app.memory import MemoryEstimate, estimate_memory, next_token_loss
from models.gpt import GPT, GPTConfig

SEED = 1337
MIB = 2**20
MODELS = {
    # about 17 M parameters with a 8k vocabulary: the blocks' activations dominate
    "4x512": GPTConfig(n_layer=4, n_head=8, n_embd=512, block_size=256, vocab_size=8192),
    # about 81 M parameters with GPT-2's vocabulary: the state and the loss's (B, T, 50257) tensors dominate
    "6x768": GPTConfig(n_layer=6, n_head=12, n_embd=768, block_size=256, vocab_size=50257),
}


@dataclass(frozen=True)
class Row:
    model: str
    micro_batch_size: int
    precision: str = "32-true"
    strategy: str = "single"  # or "ddp": DistributedDataParallel on a 1-process gloo group (its buckets)
    activation_checkpointing: bool = False
    accumulation: int = 2

    def label(self) -> str:
        return (f"{self.model} | {self.micro_batch_size} | {self.precision} | {self.strategy}"
                f"{' + checkpointing' if self.activation_checkpointing else ''} | {self.accumulation}")


ROWS = [
    Row("4x512", 8),
    Row("4x512", 16),
    Row("4x512", 8, precision="bf16-mixed"),
    Row("4x512", 8, activation_checkpointing=True),
    Row("4x512", 8, strategy="ddp"),
    Row("4x512", 8, accumulation=1),
    Row("6x768", 2),
    Row("6x768", 2, precision="bf16-mixed"),
]


def estimate(row: Row, device_type: str) -> MemoryEstimate:
    config = MODELS[row.model]
    return estimate_memory(lambda: GPT(config), next_token_loss(config.block_size, config.vocab_size),
                           row.micro_batch_size, row.precision, strategy=row.strategy,
                           activation_checkpointing=row.activation_checkpointing, device_type=device_type,
                           advise=False)


def resident_bytes(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak so far) of this process, from /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(row: Row, device_type: str) -> int:
    """Peak bytes of the training steps of ``row`` in this process (run it in a fresh one)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from models.language_model import weight_decay_groups
    from models.parallelize import build_gpt

    device = torch.device(device_type)
    config = MODELS[row.model]
    autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(row.precision)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int, vocab: int, length: int) -> None:
        for _ in range(row.accumulation):
            tokens = torch.randint(0, vocab, (batch, length + 1), device=device)
            mixed = autocast_dtype is not None
            with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=mixed):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            del logits  # Lightning's training_step returns the loss only
            loss.backward()
            del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # warm-up on a tiny model: thread pools, kernels and autocast's code paths, before the baseline
    tiny = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    warm = build_gpt(tiny, device, SEED)
    step(warm, torch.optim.AdamW(warm.parameters(), fused=True), 2, tiny.vocab_size, tiny.block_size)
    del warm
    if row.strategy == "ddp":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MEMORY_BENCHMARK_PORT", "29531"))
        dist.init_process_group("gloo" if device_type == "cpu" else "nccl", rank=0, world_size=1)
    if device_type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = resident_bytes("VmRSS")

    model = build_gpt(config, device, SEED, activation_checkpointing=row.activation_checkpointing)
    optimizer = torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-4, fused=True)
    trained = DistributedDataParallel(model) if row.strategy == "ddp" else model
    for _ in range(2):
        step(trained, optimizer, row.micro_batch_size, config.vocab_size, config.block_size)
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() - baseline
    return resident_bytes("VmHWM") - baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="*", help="indices into ROWS (default: all)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one row, measured in this process
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps({"measured": measure(ROWS[args.child], args.device)}))
        return
    print(f"estimate vs measured peak of a training step ({args.device}; the estimate "
          f"{'without its GPU allowances' if args.device == 'cuda' else 'for device_type cpu'})")
    print("model | micro batch | precision | strategy | accumulation | estimate MiB | measured MiB | error % | "
          "parameters + gradients + optimizer, activations, other (MiB)")
    errors = []
    for index in args.rows if args.rows is not None else range(len(ROWS)):
        row = ROWS[index]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MEMORY_BENCHMARK_PORT": str(29500 + index)}
        child = subprocess.run([sys.executable, "-m", "benchmarks.memory_estimate", "--child", str(index),
                                "--device", args.device], env=env, capture_output=True, text=True, check=True)
        measured = json.loads(child.stdout.strip().splitlines()[-1])["measured"]
        predicted = estimate(row, args.device)
        expected = predicted.total - predicted.overhead  # the GPU allowances are not in either counter
        error = (expected - measured) / measured * 100
        errors.append(error)
        state = predicted.parameters + predicted.gradients + predicted.optimizer_state
        print(f"{row.label()} | {expected / MIB:,.0f} | {measured / MIB:,.0f} | {error:+.1f} | "
              f"{state / MIB:,.0f}, {predicted.activations / MIB:,.0f}, {predicted.other / MIB:,.0f}", flush=True)
    print(f"largest error {max(errors, key=abs):+.1f} % (goal: within 15 %)")


if __name__ == "__main__":
    main()
