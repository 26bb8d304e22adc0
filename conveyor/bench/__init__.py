"""Benchmarks: `conveyor bench step` (the scheduler's CPU cost per step)."""
