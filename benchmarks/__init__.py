"""Benchmarks; a package so that the CLI can load ``benchmarks.lightning_overhead.StepTimer`` as a callback."""
