"""Activation checkpointing (every block) vs none on the CPU: step time and activation memory, side by side.

    python -m benchmarks.activation_checkpointing

Both models are built by models/parallel/parallelize.py from one seed. Step time: forward + backward + AdamW step,
the two variants alternating, median over the repeats. Activation memory: the bytes of every tensor created
during the forward pass that is still alive when the forward pass ends (what backward will read), counted by
a dispatch mode that tracks each output's storage. Goals (issue #3): time <= 1.35x, activations <= 0.5x.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from models.gpt.family import build_gpt
from models.gpt.network import GPT, gpt_config
from models.optimizer import weight_decay_groups


class StoragesCreated(TorchDispatchMode):
    """Remembers (weakly) the storage of every tensor an operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        output = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.storages[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        return output

    def live_bytes(self, excluded: set[int]) -> int:
        return sum(nbytes for pointer, (ref, nbytes) in self.storages.items() if not ref.expired() and pointer not in excluded)


def loss_of(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def activation_bytes(model: GPT, tokens: torch.Tensor) -> int:
    tracker = StoragesCreated()
    with tracker:
        loss = loss_of(model, tokens)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # views of weights are not activations
    live = tracker.live_bytes(excluded=weights)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return live


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="a size from models.gpt.network.GPT_CONFIGS")
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = gpt_config(args.model, n_embd=args.n_embd)
    tokens = torch.randint(0, config.vocab_size, (args.batch, config.block_size + 1), generator=torch.Generator().manual_seed(0))
    variants = {name: build_gpt(config, torch.device("cpu"), seed=1337, activation_checkpointing=checkpointed)
                for name, checkpointed in (("none", False), ("checkpointed", True))}
    optimizers = {name: torch.optim.AdamW(weight_decay_groups(model, 0.1), lr=1e-4, fused=True)
                  for name, model in variants.items()}
    memory = {name: activation_bytes(model, tokens) for name, model in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats + 2):  # the first two rounds warm up
        for name, model in variants.items():
            start = time.perf_counter()
            loss_of(model, tokens).backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            if repeat >= 2:
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.model} (n_embd {args.n_embd}, {config.n_layer} layers), batch {args.batch} x {config.block_size} tokens, "
          f"{torch.get_num_threads()} threads, {args.repeats} repeats")
    for name in variants:
        print(f"  {name:12} step {median[name] * 1e3:8.1f} ms   activations {memory[name] / 2**20:8.1f} MiB")
    print(f"checkpointed / none: step time {median['checkpointed'] / median['none']:.3f} (goal <= 1.35), "
          f"activation memory {memory['checkpointed'] / memory['none']:.3f} (goal <= 0.5)")


if __name__ == "__main__":
    main()
