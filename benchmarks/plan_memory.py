"""``cohort plan``'s memory column (``cohort doctor``'s estimate per device) against each rank's measured peak in real
``cohort fit`` runs of the layouts, on 2 CPU processes.

    python -m benchmarks.plan_memory        # the gpt2 size on the byte data, global batch 4 x 128 tokens

Layouts: the planner's fastest of each strategy (DDP, FSDP2, tensor parallel, the pipeline's fastest schedule) at
micro batch 2, activation checkpointing off and on. Each runs 2 optimizer steps after as many to warm up
(app/tools/plan_trials.py run_fit), so the peak holds the optimizer's moments.

Measured as benchmarks/memory_estimate.py measures a CPU peak: each rank's peak resident memory (VmHWM in
/proc/self/status) minus its resident memory before the network is built, with MALLOC_MMAP_THRESHOLD_=65536 (every
block above 64 KiB its own mapping, returned to the system when freed). The baseline is taken in the callback's
``setup`` (Lightning calls it before ``configure_model`` builds the network), after one forward and backward of a
small network there, so that torch's thread pools and kernels are in it as they are in the estimate's absence. The
larger rank's peak is compared, as the estimate is the larger rank's (a pipeline's larger stage).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import lightning as L
import torch
from jsonargparse import Namespace

from app.tools.cost_model import DeviceSpeed, Link, Links
from app.tools.plan import Ranking, fit_runs, rank_layouts
from app.tools.plan_trials import absolute, run_fit
from benchmarks.memory_estimate import resident_bytes

RECIPE = ["-c", "configs/quickstart.yaml", "--model.model_name", "gpt2", "--data.sequence_length", "128",
          "--data.global_batch_size", "4", "--data.micro_batch_size", "2"]
# the planner's time is not what this measures: stated constants spare the probes
SPEED = DeviceSpeed(1e10, 0.0, 1e-9, overlaps_communication=False, source="stated: memory only")
LINK = Link(1e9, 1e-5, source="stated: memory only")
MIB = 2**20


class PeakMemory(L.Callback):
    """Writes, per rank, into ``out_dir``/memory_rank{R}.json its peak resident bytes over fit above those before
    the network was built."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        warm = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
        warm(torch.randn(64, 256)).sum().backward()  # thread pools and kernels, before the baseline
        self.baseline = resident_bytes("VmRSS")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        peak = resident_bytes("VmHWM") - self.baseline
        (self.out_dir / f"memory_rank{trainer.global_rank}.json").write_text(json.dumps(peak))


def chosen(ranking: Ranking, micro_batch_size: int) -> list[int]:
    """Places in the ranking: the fastest layout of each strategy at ``micro_batch_size`` (a pipeline's fastest
    schedule), with and without activation checkpointing."""
    places: dict[tuple[str, bool], int] = {}
    for place, prediction in enumerate(ranking.ranked):
        layout = prediction.layout
        if layout.micro_batch_size == micro_batch_size:
            places.setdefault((layout.strategy, layout.activation_checkpointing), place)
    return sorted(places.values())


def measure(run: list[str], folder: Path) -> list[int]:
    """Each rank's measured peak bytes of ``run``."""
    out_dir = Path(tempfile.mkdtemp(dir=folder))
    run_fit([*absolute(RECIPE), *absolute(run), "--trainer.callbacks+=benchmarks.plan_memory.PeakMemory",
             f"--trainer.callbacks.out_dir={out_dir}"], 1, folder)
    return [json.loads(path.read_text()) for path in sorted(out_dir.glob("memory_rank*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch-size", type=int, default=2)
    options = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # the runs' processes inherit it
    args = Namespace(devices=2, nodes=1, gpu=None, device_memory=None, bandwidth=None, latency=None,
                     node_bandwidth=None, node_latency=None)
    ranking = rank_layouts(args, RECIPE, SPEED, Links(LINK, LINK, 2))
    runs = fit_runs(ranking, args, len(ranking.ranked))
    print(f"{' '.join(RECIPE)}, 2 processes\n")
    print("| layout | estimate (per device) | measured rank 0 | measured rank 1 | error (larger rank) |\n"
          "|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="plan-memory-") as folder:
        for place in chosen(ranking, options.micro_batch_size):
            prediction = ranking.ranked[place]
            peaks = measure(runs[place], Path(folder))
            error = (prediction.memory_bytes - max(peaks)) / max(peaks)
            print(f"| {prediction.layout.describe()} | {prediction.memory_bytes / MIB:,.0f} MiB | "
                  f"{' | '.join(f'{peak / MIB:,.0f} MiB' for peak in peaks)} | {error:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
