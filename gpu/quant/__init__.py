"""Quantized weights: one loaded form (weight.py), each checkpoint format's reader (scheme.py,
formats/), and their loading into the model's layers (load.py); an fp8 KV cache's per-layer
scales from the checkpoint (kv_scales.py). Kernels are the backends' (`Ops.quant_linear`);
docs/models.md lists the formats."""
