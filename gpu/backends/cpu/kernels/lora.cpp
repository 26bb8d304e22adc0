// Batched LoRA on the CPU (Ops.lora_add): each token's update from its adapter slot, read from
// `slots` (-1: the base weights, left alone), in float32:
//   y[t, :] += scales[s] * B[s] (A[s] x[t])       (A [S, R, in], B [S, out, R] stored [S, R, out])
//
// torch's path (gpu/backends/base.py) multiplies by every slot's A and B at once and picks each
// token's own with gathers, masks and scatters: about thirty small ops a projection, each a
// dispatch of several microseconds, which on SmolLM2 (210 projections a step) cost more than the
// products themselves. Here a projection is one call and one parallel region, and a token touches
// only its own slot's matrices. Tokens are taken grouped by slot, and each slot's matrices a block
// at a time (a block of A's columns, a block of B's outputs: a few KB), so that the tokens of one
// adapter read the block from L1 in turn instead of the whole matrix from L2 each (which bound
// both products to about 15 GMAC/s on SmolLM2's shapes). Compiled with -ffast-math, so sums are
// reassociated: results differ from torch's in the last bits, as two BLAS builds would.
//
// Strides are in elements; x's, a's, y's and B's output dimension is contiguous. The OpenMP pool
// is torch's (see build.py). C ABI for ctypes.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "packed_call.h"

namespace {

constexpr int64_t kSerialMacs = 1 << 16;  // below this, one thread: waking a second costs more
constexpr int kLanes = 16;                 // floats a partial sum spans: one AVX-512 vector, two AVX2
constexpr int64_t kColumns = 512;          // shrink: A's columns a block (R = 16: 32 KB)
constexpr int kOutputs = 4 * kLanes;       // expand: y's floats held in registers (R = 16: 4 KB of B)

// The tokens that have a slot, grouped by slot in slot order (a counting sort: slots are few).
std::vector<int64_t> by_slot(const int64_t* slots, int64_t T) {
  int64_t num_slots = 0;
  for (int64_t t = 0; t < T; ++t) num_slots = std::max(num_slots, slots[t] + 1);
  std::vector<int64_t> start(num_slots + 1, 0), order;
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) ++start[slots[t] + 1];
  for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
  order.resize(start[num_slots]);
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) order[start[slots[t]]++] = t;
  return order;
}

// out[j] += a row j . x over K columns, for RB rows of A at once: x's vector is loaded once for
// all of them and each row keeps its own vector of partial sums, summed across once at the end.
template <int RB>
inline void add_dot_rows(const float* x, const float* a, int64_t stride_ar, int64_t K, float* out) {
  float acc[RB][kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    for (int j = 0; j < RB; ++j) {
      const float* row = a + j * stride_ar + k;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) acc[j][l] += row[l] * x[k + l];
    }
  }
  for (int j = 0; j < RB; ++j) {
    float sum = 0.0f;
    for (int l = 0; l < kLanes; ++l) sum += acc[j][l];
    for (int64_t i = k; i < K; ++i) sum += a[j * stride_ar + i] * x[i];
    out[j] += sum;
  }
}

// shrink for one thread's share of the grouped tokens (order[lo, hi)), block of columns by block.
void shrink_run(const float* x, int64_t stride_x, const float* a, int64_t stride_as, int64_t stride_ar,
                const int64_t* slots, const int64_t* order, int64_t lo, int64_t hi, float* xa, int64_t K,
                int64_t R) {
  for (int64_t k0 = 0; k0 < K; k0 += kColumns) {
    const int64_t width = std::min(kColumns, K - k0);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t t = order[i];
      const float* xt = x + t * stride_x + k0;
      const float* as = a + slots[t] * stride_as + k0;
      float* out = xa + t * R;
      int64_t r = 0;
      for (; r + 8 <= R; r += 8) add_dot_rows<8>(xt, as + r * stride_ar, stride_ar, width, out + r);
      for (; r < R; ++r) add_dot_rows<1>(xt, as + r * stride_ar, stride_ar, width, out + r);
    }
  }
}

// expand of one block of outputs [n0, n0 + kOutputs) for every grouped token: a slot's block of
// B (stored [S, R, N]) is R short rows of outputs, and y's block gains one scaled row at a time,
// in registers.
void expand_block(float* y, int64_t stride_y, const float* xa, const float* b, int64_t stride_bs,
                  int64_t stride_br, const float* scales, const int64_t* slots,
                  const std::vector<int64_t>& order, int64_t n0, int64_t N, int64_t R) {
  const int64_t width = std::min<int64_t>(kOutputs, N - n0);
  for (const int64_t t : order) {
    const int64_t s = slots[t];
    const float* xt = xa + t * R;
    const float* bs = b + s * stride_bs + n0;
    float acc[kOutputs] = {};
    for (int64_t r = 0; r < R; ++r) {
      const float c = xt[r];
      const float* row = bs + r * stride_br;
      if (width == kOutputs) {
#pragma omp simd
        for (int l = 0; l < kOutputs; ++l) acc[l] += c * row[l];
      } else {
        for (int64_t l = 0; l < width; ++l) acc[l] += c * row[l];
      }
    }
    float* yt = y + t * stride_y + n0;
    const float scale = scales[s];
    for (int64_t l = 0; l < width; ++l) yt[l] += scale * acc[l];
  }
}

}  // namespace

extern "C" {

// x [T, K] (row stride stride_x), a [S, R, K] (strides stride_as, stride_ar), y [T, N] (row stride
// stride_y), b [S, R, N] (strides stride_bs, stride_br), scales [S], slots [T]: y[t] += scales[s]
// * b[s]^T (a[s] x[t]). Each thread first shrinks a run of the grouped tokens into xa [T, R]
// (kept here), then all expand blocks of outputs.
void conveyor_lora_add_f32(const float* x, int64_t stride_x, const float* a, int64_t stride_as,
                           int64_t stride_ar, float* y, int64_t stride_y, const float* b,
                           int64_t stride_bs, int64_t stride_br, const float* scales,
                           const int64_t* slots, int64_t T, int64_t K, int64_t N, int64_t R) {
  const std::vector<int64_t> order = by_slot(slots, T);
  const int64_t n = static_cast<int64_t>(order.size());
  std::vector<float> xa(T * R, 0.0f);
  const int64_t blocks = (N + kOutputs - 1) / kOutputs;
#pragma omp parallel if (n * R * (K + N) > kSerialMacs)
  {
    const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
    shrink_run(x, stride_x, a, stride_as, stride_ar, slots, order.data(), n * me / threads,
               n * (me + 1) / threads, xa.data(), K, R);
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk)
      expand_block(y, stride_y, xa.data(), b, stride_bs, stride_br, scales, slots, order,
                   blk * kOutputs, N, R);
  }
}

}  // extern "C"

// Its packed form, for recorded programs (packed_call.h).
CONVEYOR_PACKED(conveyor_lora_add_f32)
