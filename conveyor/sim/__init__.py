"""The scheduling simulator: the engine's own EngineCore (Scheduler, block manager, overlap and
multi-step pacing) driven by a discrete-event clock, with a forward-pass cost model in place of
the worker and a host cost for the engine's CPU work. A tool beside the serving path, which never
imports it (the layout test in tests/ops says so): the device table and the pass cost models it
shares with the emulated device live with the device, in gpu/emulated/.

calibrate.py    builds the emulated device's calibration tables from GPU run records
gemm_roofline.py  one (quantized) linear layer's roofline: the issue-29 estimates
hostcost.py     the host's work per plan
presets.py      shipped cost models (cpu-tiny measured, a100-* and h100-llama3-8b derived)
measure.py      times the real ModelRunner on the tiny model and fits cpu-tiny
workloads.py    ShareGPT and synthetic requests, Poisson or closed-loop arrivals
simulator.py    the event loop
run_metrics.py  throughput, TTFT, token latency, TPOT, E2E, effective throughput, KV waste
report.py       the comparison table; __main__.py the CLI (docs/simulator.md)
"""
