// The decoder's elementwise work on the CPU, one pass each: RMSNorm (with the residual add
// folded in), rotary embedding of q and k in place, SiLU(gate) * up, the column copy that
// splits a stacked product's rows into its outputs, and the embedding's row gather.
//
// In torch each of these is five to fifteen small ops: an RMSNorm is a cast, a square, a mean,
// an add, an rsqrt and two multiplies, every one a dispatch of several microseconds and, at a
// prompt chunk of 2048 tokens, a pass over megabytes. Fused, a step of 256 decodes spends ~1 ms
// less here per forward, and a 2048-token chunk ~8 ms less (docs/benchmarks.md).
//
// Same arithmetic as the torch path in gpu/models/llama.py and gpu/models/rope.py, in float32:
//   rms_norm:   r = x (+ residual); out = w * (r * 1 / sqrt(mean(r^2) + eps))
//   rotary:     x1, x2 = halves of each head; (x1 c - x2 s, x2 c + x1 s), "rotate half" layout
//   silu_mul:   gate = gate / (1 + exp(-gate)) * up
// compiled with -ffast-math, so sums are reassociated: results differ from torch's in the last
// bits, as two BLAS builds would.
//
// Rows are independent; the OpenMP pool is torch's (see build.py). C ABI for ctypes.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "packed_call.h"

namespace {

constexpr int64_t kSerialElements = 1 << 15;  // below this, one thread: waking a second costs more

}  // namespace

extern "C" {

// x, out [T, H]; residual [T, H] or null; w [H]. With residual: residual += x, then out is the
// norm of the sum (the residual stream the next layer reads). out may alias x.
void conveyor_rms_norm_f32(const float* x, float* residual, const float* w, float* out, int64_t T,
                           int64_t H, float eps) {
#pragma omp parallel for if (T * H > kSerialElements)
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * H;
    float* ot = out + t * H;
    const float* r = xt;
    if (residual != nullptr) {
      float* rt = residual + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) rt[i] += xt[i];
      r = rt;
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < H; ++i) sum += r[i] * r[i];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(H) + eps);
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) ot[i] = w[i] * (r[i] * inv);
  }
}

// q [T, Hq, D] and k [T, Hkv, D] rotated in place; positions [T]; cos_sin [P, D]: cos of the
// D/2 frequencies, then their sin (gpu/models/rope.py's table).
void conveyor_rotary_f32(float* q, float* k, const int64_t* positions, const float* cos_sin,
                         int64_t T, int64_t num_heads, int64_t num_kv_heads, int64_t D) {
  const int64_t half = D / 2;
#pragma omp parallel for if (T * (num_heads + num_kv_heads) * D > kSerialElements)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos_sin + positions[t] * D;
    const float* s = c + half;
    for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
      float* x = h < num_heads ? q + (t * num_heads + h) * D : k + (t * num_kv_heads + h - num_heads) * D;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = x[j], x2 = x[j + half];
        x[j] = x1 * c[j] - x2 * s[j];
        x[j + half] = x2 * c[j] + x1 * s[j];
      }
    }
  }
}

// gate, up [n]: gate = silu(gate) * up, in place. Threads take chunks; each chunk is one simd
// loop (a combined `parallel for simd` ran scalar expf when its `if` kept it on one thread).
void conveyor_silu_mul_f32(float* gate, const float* up, int64_t n) {
  constexpr int64_t kChunk = 4096;
#pragma omp parallel for if (n > kSerialElements)
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t end = start + kChunk < n ? start + kChunk : n;
#pragma omp simd
    for (int64_t i = start; i < end; ++i) gate[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
}

// dst [rows, cols] = the columns of src [rows, ld_src] from its row starts: one output of a
// stacked product (q of q/k/v), made contiguous for the kernels that read it.
void conveyor_copy_columns_f32(const float* src, int64_t ld_src, float* dst, int64_t rows, int64_t cols) {
#pragma omp parallel for if (rows * cols > kSerialElements)
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * cols, src + r * ld_src, cols * sizeof(float));
}

}  // extern "C"

// Their packed forms, for recorded programs (packed_call.h).
CONVEYOR_PACKED(conveyor_rms_norm_f32)
CONVEYOR_PACKED(conveyor_rotary_f32)
CONVEYOR_PACKED(conveyor_silu_mul_f32)
CONVEYOR_PACKED(conveyor_copy_columns_f32)

extern "C" {

// out [T, H] = rows ids[t] of table [V, H] (an embedding lookup; fused_ops.py `embedding`). An
// id outside [0, V) gives a row of zeros, never a read outside the table.
void conveyor_embedding_f32(const float* table, const int64_t* ids, float* out, int64_t T, int64_t H, int64_t V) {
#pragma omp parallel for if (T * H > kSerialElements)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = ids[t];
    if (id >= 0 && id < V)
      std::memcpy(out + t * H, table + id * H, H * sizeof(float));
    else
      std::memset(out + t * H, 0, H * sizeof(float));
  }
}

}  // extern "C"

CONVEYOR_PACKED(conveyor_embedding_f32)
