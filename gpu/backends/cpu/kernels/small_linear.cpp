// y = x W^T (+ bias) for narrow layers (up to 1024 input features; small_linear.py decides).
//
// Written for the decode steps of a lightly loaded server: with a handful of rows a linear layer is a read of its weights and little else: at one row,
// the tiny model's 29 weight matrices (16 MB) take about 0.6 ms to stream from memory on two
// cores. torch's sgemm took 1.6 to 2.5 ms for them: its kernels are built for tall inputs and
// repack the weights on every call. Here the weights are kept transposed, wt [K, N] (the
// runner's Linear parameters become views of that storage, so torch's GEMM still serves tall
// inputs from the same memory), and each thread streams its own columns of wt once:
//   for each block of 32 output columns, for each k: one row slice of wt (two 16-lane vectors)
//   times x[m, k] broadcast, into MB x 2 accumulators that stay in registers;
// rows beyond MB (8) come around again for the same block, while it is still in L2. On this
// model family's narrow layers that also beat sgemm on tall inputs (docs/benchmarks.md).
//
// C ABI for ctypes; the OpenMP pool is torch's (see build.py).

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "packed_call.h"
#include "vector_math.h"  // vectors as wide as the target's registers (a 64-byte vector on AVX2
                          // spilled every accumulator: why this kernel once lost to sgemm there)

namespace {

#if defined(__AVX512F__)
constexpr int kMaxRows = 8;  // rows per pass: 8 x 2 accumulators + 2 weight vectors of 32 zmm
#else
constexpr int kMaxRows = 6;  // 6 x 2 accumulators + 2 weight vectors + a broadcast of 16 ymm
#endif

// Rows [0, MB) of x, columns [n0, n0 + NV * 16) of y.
template <int MB, int NV>
void column_block(const float* __restrict x, const float* __restrict wt,
                  const float* __restrict bias, float* __restrict y, int64_t K, int64_t N,
                  int64_t n0) {
  v16 acc[MB][NV];
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = bias ? load16(bias + n0 + v * kLanes) : v16{};
  const float* w = wt + n0;
  for (int64_t k = 0; k < K; ++k, w += N) {
    v16 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load16(w + v * kLanes);
    for (int m = 0; m < MB; ++m) {
      const float xm = x[m * K + k];
      for (int v = 0; v < NV; ++v) acc[m][v] += xm * wv[v];
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int v = 0; v < NV; ++v) store16(y + m * N + n0 + v * kLanes, acc[m][v]);
}

template <int MB>
void rows(const float* x, const float* wt, const float* bias, float* y, int64_t K, int64_t N,
          int64_t n0) {
  if (n0 + 2 * kLanes <= N)
    column_block<MB, 2>(x, wt, bias, y, K, N, n0);
  else
    column_block<MB, 1>(x, wt, bias, y, K, N, n0);
}

// The weight as stored, w [N, K] (an nn.Linear's layout; the tied LM head's, which the embedding
// needs as it is): y[m, n0 + n] = x[m] . w[n0 + n] for m < MB, n < NB. The NB rows stream side by
// side, each k vector of theirs meeting MB rows of x; the block NB rows on is asked for first.
template <int MB, int NB>
void row_block(const float* __restrict x, const float* __restrict w, const float* __restrict bias,
               float* __restrict y, int64_t K, int64_t N, int64_t n0) {
  const int64_t ahead = n0 + std::max<int64_t>(NB, kPrefetchBytes / (K * 4));
  if (ahead < N) prefetch_span(w + ahead * K, std::min<int64_t>(NB, N - ahead) * K);
  v16 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = v16{};
  const float* wn = w + n0 * K;
  for (int64_t k = 0; k < K; k += kLanes) {
    v16 xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = load16(x + m * K + k);
    for (int n = 0; n < NB; ++n) {
      const v16 wv = load16(wn + n * K + k);
      for (int m = 0; m < MB; ++m) acc[m][n] += xv[m] * wv;
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      float sum = 0.f;
      for (int l = 0; l < kLanes; ++l) sum += acc[m][n][l];
      y[m * N + n0 + n] = sum + (bias ? bias[n0 + n] : 0.f);
    }
}

#if defined(__AVX512F__)
constexpr int kRowMB = 4, kRowNB = 4;  // 16 accumulators, 4 x vectors, a weight vector: of 32 zmm
#else
constexpr int kRowMB = 2, kRowNB = 4;  // 8 + 2 + 1 of 16 ymm
#endif

template <int NB>
void row_blocks(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                int64_t n0) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowMB) {  // rows past kRowMB read the block again, from L1
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N;
    switch (M - m0 < kRowMB ? M - m0 : kRowMB) {
      case 1: row_block<1, NB>(xm, w, bias, ym, K, N, n0); break;
#if defined(__AVX512F__)
      case 2: row_block<2, NB>(xm, w, bias, ym, K, N, n0); break;
      case 3: row_block<3, NB>(xm, w, bias, ym, K, N, n0); break;
#endif
      default: row_block<kRowMB, NB>(xm, w, bias, ym, K, N, n0); break;
    }
  }
}

}  // namespace

extern "C" {

// x [M, K], w [N, K] row-major, bias [N] or null -> y [M, N], for few rows (small_linear.py's
// ROW_MAX_ROWS): a read of w, blocks of kRowNB of its rows spread over threads. K must be a
// multiple of the vector width (the caller checks).
void conveyor_row_linear_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K,
                             int64_t N) {
  const int64_t num_blocks = (N + kRowNB - 1) / kRowNB;
#pragma omp parallel for schedule(static) if (K * N > (1 << 15))
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n0 = b * kRowNB;
    if (n0 + kRowNB <= N)
      row_blocks<kRowNB>(x, w, bias, y, M, K, N, n0);
    else
      for (int64_t n = n0; n < N; ++n) row_blocks<1>(x, w, bias, y, M, K, N, n);
  }
}

// x [M, K], wt [K, N], bias [N] or null -> y [M, N]. N must be a multiple of 16 (the caller
// checks). Column blocks of two vectors are spread over threads when the weights are worth it.
void conveyor_small_linear_f32(const float* x, const float* wt, const float* bias, float* y,
                               int64_t M, int64_t K, int64_t N) {
  const int64_t num_blocks = (N + 2 * kLanes - 1) / (2 * kLanes);
#pragma omp parallel for schedule(static) if (K * N > (1 << 15))
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n0 = b * 2 * kLanes;
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const float* xm = x + m0 * K;
      float* ym = y + m0 * N;
      switch (M - m0 < kMaxRows ? M - m0 : kMaxRows) {
        case 1: rows<1>(xm, wt, bias, ym, K, N, n0); break;
        case 2: rows<2>(xm, wt, bias, ym, K, N, n0); break;
        case 3: rows<3>(xm, wt, bias, ym, K, N, n0); break;
        case 4: rows<4>(xm, wt, bias, ym, K, N, n0); break;
        case 5: rows<5>(xm, wt, bias, ym, K, N, n0); break;
#if defined(__AVX512F__)
        case 6: rows<6>(xm, wt, bias, ym, K, N, n0); break;
        case 7: rows<7>(xm, wt, bias, ym, K, N, n0); break;
        default: rows<8>(xm, wt, bias, ym, K, N, n0); break;
#else
        default: rows<6>(xm, wt, bias, ym, K, N, n0); break;
#endif
      }
    }
  }
}

}  // extern "C"

// Their packed forms, for recorded programs (packed_call.h).
CONVEYOR_PACKED(conveyor_small_linear_f32)
CONVEYOR_PACKED(conveyor_row_linear_f32)
