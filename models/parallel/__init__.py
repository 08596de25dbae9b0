"""Parallelism for any network (tensor parallelism, activation checkpointing, compile, FSDP2, pipeline stages),
applied from outside by the family classes: no network imports it."""
