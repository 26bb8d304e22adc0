"""Model implementations, one file per family, each a CausalLM (base.py) with its config adapter.

llama.py (Llama, Mistral, Qwen2, Qwen3, and the layers the others build on), gemma.py (Gemma 2,
Gemma 3 text), phi3.py (Phi-3), mixtral.py and qwen3_moe.py (Mixtral, Qwen2-MoE, Qwen3-MoE: the
experts in moe.py), llava.py and qwen2_vl.py (vision-language: their towers in vision/, M-RoPE in
mrope.py). rope.py holds the rotary cos/sin tables every family reads. registry.py maps
each architecture name to its class and adapter, one line each; `read_model_config` and `build_model` go through it.
"""

from conveyor.gpu.models.base import CausalLM
from conveyor.gpu.models.registry import ARCHITECTURES, build_model, read_model_config

__all__ = ["ARCHITECTURES", "CausalLM", "build_model", "read_model_config"]
