"""The Triton backend: the attention backend and ops for CUDA, written as Triton kernels.

backend.py puts the pieces behind the seam (conveyor.gpu.backends.base): the KV cache, one tensor per
layer of [2, num_blocks, block_size, Hkv, D] (keys, then values); the per-step metadata
(query_start_loc, seq_lens, block tables and slot mapping, on the device); writing the step's K/V
through the slot mapping (kv_write.py); one paged attention launch over a whole mixed step of
decode rows and prompt chunks, reading K/V in place through the block tables (paged_attention.py);
and the ops: residual add + RMSNorm (add_rms_norm.py), rotary embedding in place on q and k
(rotary.py), with linear and SiLU x up in torch where no kernel of ours does better; a quantized
linear dequantizes inside its GEMM (quant_linear.py, split-K summed by quant_linear_reduce.py), or
multiplies in FP8 on the tensor cores (fp8_linear.py, torch._scaled_mm).

Each kernel is one file with a thin wrapper that checks shapes and strides and a torch reference
its test compares against. triton is imported only when this backend is selected: nothing under
conveyor.gpu imports this package otherwise, so the torch and cpu backends run without triton.
On CPU tensors the kernels run under Triton's interpreter (TRITON_INTERPRET=1 in the environment
before triton is imported): slow, but the same code, which is how CI tests every kernel and the
backend end to end without a GPU.
"""
