"""The emulated device (`conveyor serve --device emulated --emulate h100`): a GPU's work modelled,
everything on the host run for real, so the host pipeline's cost at GPU speed is measured on a
machine without one.

- platform.py: EmulatedPlatform, the runner's seam (gpu/step/platform.py) for it; KV capacity from
  the device's memory;
- stream.py: the virtual stream, its events and the copies behind them;
- model.py: the model and attention backend that queue a pass's time and hold nothing;
- devices.py: the device table (FLOP/s, bandwidths, memory), torch-free (config names its rows);
- costmodel.py, roofline.py: a pass's time from its shape: fitted, or launch + max(memory,
  compute); calibrated.py: from the device's table of measured kernel times (calibration/,
  written by the simulator's calibrate command); the simulator (conveyor/sim/) uses them too;
- footprint.py: a model's parameters, KV bytes and FLOPs from its config, and its pass roofline
  on a device of the table;
- host_link.py: the KV host tier's copies as time on the host link;
- draws.py: deterministic ids from the tokenizer's ordinary vocabulary, under grammar masks.
Every figure it gives is emulated: the log, /v1/models and the worker's metrics say so.
"""
