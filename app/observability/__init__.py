"""Seeing every rank: the monitor, progress in optimizer steps, the TensorBoard layout, FLOPs, NCCL's flight recorder.
Knows no strategy: a strategy announces what it does (app/observability/monitor.py's protocols) to whoever listens."""
