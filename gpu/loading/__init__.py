"""Checkpoints into models: a Hugging Face safetensors checkpoint loaded into our model
(loader.py), and GGUF files converted once into such a checkpoint (gguf/) at model resolution.
Quantized weights' formats and their loading into layers are gpu/quant/'s, which the loader calls.
"""
