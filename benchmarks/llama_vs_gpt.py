"""The Llama family's training step against the GPT's of the same depth and width, side by side.

    python -m benchmarks.llama_vs_gpt                          # the "small" sizes (4 x 128, vocab 256), CPU
    python -m benchmarks.llama_vs_gpt --model small --device cuda --precision bf16-mixed

A step is forward + backward of one micro-batch of ``--batch`` sequences of the model's context (the families' own
loss), then an AdamW step: what ``cohort fit`` runs per micro-batch, without Lightning. The two models take turns
step by step, so drifts in host speed hit both alike; medians after two warm-up rounds. Both families are built as
``cohort fit`` builds them (models.parallel.parallelize.build_network, the run's seed), and their FLOPs per token are the
families' own counts, so the tokens/s and the FLOP/s are comparable.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from core.precision import precision_named
from models.causal_language_model import CausalLanguageModel
from models.gpt.family import GPTLanguageModel
from models.llama.family import LlamaLanguageModel
from models.optimizer import weight_decay_groups
from models.parallel.parallelize import build_network


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a size both families have: debug or small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="32-true", help="32-true or bf16-mixed")
    args = parser.parse_args()
    device, precision = torch.device(args.device), precision_named(args.precision)
    families: dict[str, CausalLanguageModel] = {"GPT": GPTLanguageModel(args.model),
                                                "Llama": LlamaLanguageModel(args.model)}
    context = min(family.config.block_size for family in families.values())
    tokens = torch.randint(0, 256, (args.batch, context + 1), generator=torch.Generator().manual_seed(0)).to(device)
    batch = (tokens[:, :-1], tokens[:, 1:])
    networks = {name: build_network(family.plain_network, device, seed=1337) for name, family in families.items()}
    optimizers = {name: torch.optim.AdamW(weight_decay_groups(network, 0.1), lr=1e-4)
                  for name, network in networks.items()}
    autocast = (torch.autocast(device.type, dtype=precision.autocast_dtype) if precision.autocast_dtype
                else contextlib.nullcontext())
    seconds: dict[str, list[float]] = {name: [] for name in families}
    for repeat in range(args.repeats + 2):
        for name, family in families.items():
            synchronize(device)
            start = time.perf_counter()
            with autocast:
                loss = family.batch_loss(networks[name], batch)
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            synchronize(device)
            if repeat >= 2:
                seconds[name].append(time.perf_counter() - start)
    print(f"{args.model}, batch {args.batch} x {context} tokens, {precision.name}, {device}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print("family | parameters | step ms | tokens/s | GFLOP/s | step vs GPT")
    gpt_step = statistics.median(seconds["GPT"])
    for name, family in families.items():
        step = statistics.median(seconds[name])
        tokens_per_second = args.batch * context / step
        flops = family.training_flops_per_token(context) * tokens_per_second
        print(f"{name} | {family.num_parameters():,} | {step * 1e3:.1f} | {tokens_per_second:,.0f} | "
              f"{flops / 1e9:.2f} | {step / gpt_step:.2f}x")


if __name__ == "__main__":
    main()
