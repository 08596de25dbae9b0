"""app/tools/memory.py's estimate against the measured peak memory of real training steps, one fresh process per row,
for every model family, through the same CohortModule calls as ``cohort doctor``.

    python -m benchmarks.memory_estimate               # every row; about 10 minutes on 2 idle CPU cores
    python -m benchmarks.memory_estimate --rows 0 4    # some of them
    python -m benchmarks.memory_estimate --device cuda # on a GPU: CUDA peaks instead (not run yet: no GPU lent)

Each row names a family and size, with the config fields it overrides (``MODELS``), and builds that family's
LightningModule (models/<family>/family.py). The estimate is the
doctor's: ``estimate_memory(module.plain_network, module_step_loss(module, sequence_length), ...)``, i.e. the
module's example batch on the meta device through its ``batch_loss``. The measurement, in a new Python process,
builds the network as the app does (``module.configure_model()`` with no trainer: models/parallel/parallelize.py's
build_network on the CPU, with the module's activation checkpointing), then runs two optimizer steps of
``accumulation`` micro-batches each: a random batch of the example batch's shape (token ids below the vocabulary,
labels below the classes, normal images), ``module.batch_loss`` under autocast for mixed precision, backward;
fused AdamW with the app's weight-decay groups; gradients set to None after each step, as Lightning does. The
second step is the steady state: the optimizer's moments exist from its first micro-batch on.

How the peak is measured:
- CPU: the process's peak resident memory (VmHWM in /proc/self/status) minus its resident memory after imports
  and a warm-up step of the family's tiny size (thread pools, kernels), taken before the model is built. torch's
  CPU allocator keeps no statistics (``torch.cuda.memory_stats`` is GPU only, and the profiler's ``profile_memory``
  records each allocation at a cost that would dominate these steps), and it caches nothing, so the high-water mark
  of the process is the peak of live tensors plus malloc's slack. That slack is kept small by
  MALLOC_MMAP_THRESHOLD_=65536 in the child's environment: every block above 64 KiB gets its own mapping, returned
  to the system when freed, instead of glibc's default that moves the threshold up after each large free and
  leaves freed tensors in the heap.
- CUDA: ``torch.cuda.max_memory_allocated`` over the steps, from an empty device. The estimate is compared
  without its allowances (CUDA context, fragmentation), which that counter does not see.

Models are big enough (hundreds of MB per row) that the interpreter's noise (a few MB) is small.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._pytree import tree_map

from app.tools.memory import MemoryEstimate, estimate_memory
from app.tools.memory_profile import module_step_loss
from core.precision import precision_named
from models.bert.family import BertMaskedLanguageModel
from models.gpt.family import GPTLanguageModel
from models.module import CohortModule
from models.optimizer import weight_decay_groups
from models.resnet.family import ImageClassifier

MIB = 2**20


@dataclass(frozen=True)
class Model:
    """A family's named size with some config fields replaced, and the data it sees."""

    family: str  # "gpt", "bert" or "resnet"
    size: str  # the family's model_name
    overrides: tuple[tuple[str, Any], ...] = ()  # config fields replaced in the named size
    sequence_length: int = 0  # tokens per sample (GPT, BERT); images ignore it
    image_shape: tuple[int, int] = (32, 32)  # (height, width) of RGB images (ResNet)


MODELS = {
    # GPT, 17 M parameters with an 8k vocabulary: the blocks' activations dominate
    "4x512": Model("gpt", "gpt2", (("n_layer", 4), ("n_head", 8), ("n_embd", 512), ("block_size", 256),
                                   ("vocab_size", 8192)), sequence_length=256),
    # GPT, 81 M parameters with GPT-2's vocabulary: the state and the loss's (B, T, 50257) tensors dominate
    "6x768": Model("gpt", "gpt2", (("n_layer", 6), ("block_size", 256)), sequence_length=256),
    # BERT (post-LayerNorm, dropout 0.1, tied decoder), 19 M parameters on byte-level data (vocabulary 260)
    "bert 6x512": Model("bert", "bert-base", (("n_layer", 6), ("n_head", 8), ("n_embd", 512),
                                              ("intermediate_size", 2048)), sequence_length=256),
    # ResNet-18 with the CIFAR stem (11 M parameters), 10 classes: BatchNorm and convolutions, no attention
    "resnet-18 32x32": Model("resnet", "resnet-18", image_shape=(32, 32)),
}
# the warm-up before the baseline: each family's smallest size, so that its kernels are loaded
TINY = {"gpt": Model("gpt", "debug", sequence_length=64), "bert": Model("bert", "bert-tiny", sequence_length=64),
        "resnet": Model("resnet", "resnet-tiny")}


@dataclass(frozen=True)
class Row:
    model: str  # a key of MODELS
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
    Row("bert 6x512", 8),
    Row("bert 6x512", 8, precision="bf16-mixed"),
    Row("bert 6x512", 8, activation_checkpointing=True),
    Row("bert 6x512", 8, precision="bf16-mixed", activation_checkpointing=True),
    Row("resnet-18 32x32", 128),
    Row("resnet-18 32x32", 128, precision="bf16-mixed"),
]


def build_module(model: Model, activation_checkpointing: bool = False) -> CohortModule:
    """The family's LightningModule at ``model``'s size, its config fields overridden; the network is not built."""
    if model.family == "gpt":
        module: CohortModule = GPTLanguageModel(model.size, activation_checkpointing=activation_checkpointing)
    elif model.family == "bert":
        module = BertMaskedLanguageModel(model.size, vocab_size=256, activation_checkpointing=activation_checkpointing)
    elif model.family == "resnet":
        module = ImageClassifier(model.size, num_classes=10, in_channels=3, image_shape=model.image_shape)
    else:
        raise ValueError(f"unknown family {model.family!r}: gpt, bert or resnet")
    module.config = replace(module.config, **dict(model.overrides))
    return module


def estimate(row: Row, device_type: str) -> MemoryEstimate:
    """What ``cohort doctor`` (app/tools/doctor.py ``check_memory``) estimates for this row."""
    model = MODELS[row.model]
    module = build_module(model, row.activation_checkpointing)
    return estimate_memory(module.plain_network, module_step_loss(module, model.sequence_length),
                           row.micro_batch_size, row.precision, strategy=row.strategy,
                           activation_checkpointing=bool(module.hparams.get("activation_checkpointing")),
                           device_type=device_type, advise=False)


def random_batch(module: CohortModule, micro_batch_size: int, sequence_length: int, device: torch.device) -> Any:
    """A batch of the example batch's shape with random content: ids below the vocabulary or the classes, normal
    floats (images)."""
    example = module.example_batch(micro_batch_size, sequence_length, device)
    high = getattr(module.config, "vocab_size", None) or module.config.num_classes
    return tree_map(lambda t: torch.randn_like(t) if t.is_floating_point() else torch.randint_like(t, high), example)


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

    device = torch.device(device_type)
    model = MODELS[row.model]
    autocast_dtype = precision_named(row.precision).autocast_dtype

    def train(spec: Model, module: CohortModule, network: torch.nn.Module, batch_size: int) -> None:
        """Two optimizer steps of ``row.accumulation`` micro-batches each."""
        optimizer = torch.optim.AdamW(weight_decay_groups(module.model, module.optimizer_settings.weight_decay), lr=1e-4,
                                      fused=True)
        for _ in range(2):
            for _ in range(row.accumulation):
                batch = random_batch(module, batch_size, spec.sequence_length, device)
                with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=bool(autocast_dtype)):
                    loss = module.batch_loss(network, batch)  # Lightning's training_step returns the loss only
                loss.backward()
                del loss, batch
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    def built(spec: Model) -> CohortModule:
        module = build_module(spec, row.activation_checkpointing)
        module.configure_model()  # no trainer: built whole on the CPU, as load_from_checkpoint does
        module.model.to(device)
        return module

    warm = built(TINY[model.family])  # thread pools, kernels and autocast's code paths, before the baseline
    train(TINY[model.family], warm, warm.model, 2)
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

    module = built(model)
    network = DistributedDataParallel(module.model) if row.strategy == "ddp" else module.model
    train(model, module, network, row.micro_batch_size)
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
    print(f"errors {min(errors):+.1f} … {max(errors):+.1f} %, largest {max(errors, key=abs):+.1f} % "
          "(goal: within 15 %)")


if __name__ == "__main__":
    main()
