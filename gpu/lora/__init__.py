"""LoRA adapters on the worker: the slots every projection reads (slots.py) and an adapter's
tensors read from its PEFT directory (weights.py), which the `conveyor.config.lora_adapter` reader
has checked. The batched shrink and expand are the backends' (`Ops.lora_shrink`, `Ops.lora_expand`)."""
