"""AdamW's fused kernel vs its foreach and per-parameter (for-loop) implementations: optimizer-step time and whole
training-step time, side by side, in float32 and under bf16 autocast.

    python -m benchmarks.fused_optimizer                       # small and gpt2 shapes (vocab 256), CPU
    python -m benchmarks.fused_optimizer --device cuda         # the same on a GPU

A training step is what GPTLanguageModel does: forward (under autocast for bf16-mixed) + backward + clipping at
1.0 by ``models.parallel.parallelize.clip_grad_norm_`` + AdamW step over the two weight-decay groups + zero_grad. The three
optimizers train three copies of one model (same seed, same batch), taking turns step by step, so drifts in host
speed hit them alike; medians over the repeats after two warm-up rounds. GPTLanguageModel uses fused=True.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from models.gpt.family import build_gpt
from models.gpt.network import GPT, gpt_config
from models.optimizer import weight_decay_groups
from models.parallel.parallelize import clip_grad_norm_

LEARNING_RATE = 1e-4
IMPLEMENTATIONS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: GPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, precision: str) -> float:
    """One step; returns the seconds spent in ``optimizer.step``."""
    autocast = (torch.autocast(tokens.device.type, dtype=torch.bfloat16) if precision == "bf16-mixed"
                else contextlib.nullcontext())
    with autocast:
        logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    clip_grad_norm_(model, [p for group in optimizer.param_groups for p in group["params"]], 1.0)
    synchronize(tokens.device)
    start = time.perf_counter()
    optimizer.step()
    synchronize(tokens.device)
    seconds = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=True)
    return seconds


def measure(model_name: str, precision: str, batch: int, repeats: int, device: torch.device) -> dict[str, dict[str, float]]:
    config = gpt_config(model_name, vocab_size=256)
    tokens = torch.randint(0, 256, (batch, config.block_size + 1), generator=torch.Generator().manual_seed(0)).to(device)
    models = {name: build_gpt(config, device, seed=1337) for name in IMPLEMENTATIONS}
    optimizers = {name: torch.optim.AdamW(weight_decay_groups(models[name], 0.1), lr=LEARNING_RATE, **options)
                  for name, options in IMPLEMENTATIONS.items()}
    step_times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    optimizer_times: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    for repeat in range(repeats + 2):  # the first two rounds warm up
        order = list(IMPLEMENTATIONS) if repeat % 2 == 0 else list(reversed(IMPLEMENTATIONS))
        for name in order:
            synchronize(device)
            start = time.perf_counter()
            optimizer_seconds = train_step(models[name], optimizers[name], tokens, precision)
            synchronize(device)
            if repeat >= 2:
                step_times[name].append(time.perf_counter() - start)
                optimizer_times[name].append(optimizer_seconds)
    # the same training: equal to rounding in float32; under bf16 autocast, rounding flips grow into differences,
    # but within what the updates could move a weight (lr per Adam step)
    atol = 1e-6 if precision == "32-true" else LEARNING_RATE * (repeats + 2)
    weights = {name: next(iter(model.parameters())) for name, model in models.items()}
    assert all(torch.allclose(weights[name], weights["fused"], rtol=1e-4, atol=atol) for name in weights), \
        "the three implementations trained different weights"
    return {name: {"step": statistics.median(step_times[name]), "optimizer": statistics.median(optimizer_times[name])}
            for name in IMPLEMENTATIONS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["small", "gpt2"],
                        help="sizes from models.gpt.network.GPT_CONFIGS")
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--batch", type=int, default=8, help="samples of block_size tokens per step")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"{device.type}, {torch.get_num_threads()} threads, batch {args.batch} x block_size, {args.repeats} repeats; "
          "median ms per step (optimizer.step alone in brackets); ratios are X / fused")
    for model_name in args.models:
        with torch.device("meta"):
            parameters = sum(p.numel() for p in GPT(gpt_config(model_name, vocab_size=256)).parameters())
        for precision in args.precisions:
            result = measure(model_name, precision, args.batch, args.repeats, device)
            fused = result["fused"]
            cells = [f"{name} {r['step'] * 1e3:7.1f} ({r['optimizer'] * 1e3:6.1f})" for name, r in result.items()]
            ratios = [f"{name} {r['step'] / fused['step']:.3f} ({r['optimizer'] / fused['optimizer']:.2f})"
                      for name, r in result.items() if name != "fused"]
            print(f"{model_name:6} {parameters / 1e6:5.1f}M {precision:10} | {' | '.join(cells)} | ratios: {', '.join(ratios)}")


if __name__ == "__main__":
    main()
