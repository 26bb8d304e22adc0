"""Execution backends: the attention backend and ops the model runs on (interfaces: base.py).

`select(name, device, model_config)` is filled in by the seam's next commit.
"""
