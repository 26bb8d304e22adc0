"""LoRA adapters on the worker: their tensors read from a PEFT directory (weights.py) that
config/lora_adapter.py has checked. The batched shrink / expand are the backends' (`Ops.lora_shrink`,
`Ops.lora_expand`); the slots they read are the model's."""
