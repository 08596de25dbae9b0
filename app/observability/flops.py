"""FLOPs of a training step and the peak FLOP/s of devices (from data sheets, or measured), for TFLOP/s and MFU.

The training FLOPs of a sample are counted by torch's FlopCounterMode over a forward and backward pass of the
model family's network on the meta device (``CohortModule.flops_per_sample``), which costs no memory and no compute;
the GPT family checks the count against the standard formula (models/gpt/network.py ``training_flops_per_token``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# Dense peak TFLOP/s per device, without sparsity, from the vendors' data sheets (SXM parts).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
}


# the data sheets' column for each compute dtype (float32 matmuls run as TF32 unless torch is told "highest")
SHEET_COLUMNS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "tf32"}


def peak_tflops_per_device(device_name: str, compute_dtype: torch.dtype) -> float | None:
    """The table's peak for this GPU and the precision's compute dtype; None when the device is not in the table
    (e.g. a CPU)."""
    kind = SHEET_COLUMNS[compute_dtype]
    if kind == "tf32" and torch.get_float32_matmul_precision() == "highest":
        kind = "fp32"
    for model, peaks in PEAK_TFLOPS.items():
        if model in device_name:
            return peaks[kind]
    return None


def measured_peak_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 0.2,
                         clock: Callable[[], float] = time.perf_counter) -> float:
    """The matmul TFLOP/s this device reaches now in ``dtype`` (the precision's compute dtype): square matmuls,
    repeated for about ``seconds`` of ``clock`` after one to warm up. The peak for MFU where the table has none (a
    CPU, an unlisted GPU)."""
    size = 4096 if device.type == "cuda" else 512
    a, b = torch.randn(size, size, device=device, dtype=dtype), torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up: kernel selection, thread pools
    count, start = 0, clock()
    while True:
        a @ b
        count += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = clock() - start
        if elapsed >= seconds:
            return 2 * size**3 * count / elapsed / 1e12
