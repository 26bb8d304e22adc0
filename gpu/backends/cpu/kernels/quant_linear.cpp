// y = x W^T (+ bias) with W a QuantizedWeight read packed (gpu/quant/weight.py; the ctypes face
// and the choice of path: quant_linear.py):
//   w[n, k] = code[n, k] * scales[n, k / G] + mins[n, k / G]
//
// Three ways, for three sizes of step:
// - int8 (quant_int8.h), for few rows (decode): x quantized to int8 planes once per call, the
//   codes multiplied as bytes, W's codes streamed once; memory-bound on a one-row step.
// - direct, the same few rows where there is no int8 path (e4m3; a build without AVX2): each
//   chunk of codes decoded into float registers (quant_decode.h), scaled by one FMA that folds
//   scale and min, and used by every row of x of the pass (`block`: MB rows x NB outputs).
// - dequantize, for many rows (prefill): rows of W decoded into the caller's float scratch, a
//   bounded slice at a time, for torch's GEMM (quant_linear.py). Decoding is N x K work, the
//   GEMM M x N x K: at 512 rows and more it costs a few percent, and no hand-written kernel
//   here matched torch's GEMM (a register-blocked tile kernel ran 1.5x slower on this machine).
// Sums are reassociated (-ffast-math): results differ from F.linear on the dequantized weight
// in the last bits, as two BLAS builds would. Beside the product: rows of W picked by index (a
// quantized embedding table's lookup, conveyor_quant_rows_f32), decoded as `dequantize` does.
//
// C ABI for ctypes; the OpenMP pool is torch's (see build.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "packed_call.h"
#include "quant_decode.h"
#include "quant_int8.h"

namespace {

#if defined(__AVX512F__)
constexpr int kMB = 4, kNB = 4;  // MB x NB accumulators, NB x 2 weight vectors and their scales: <= 32 zmm
#else
constexpr int kMB = 3, kNB = 2;  // <= 16 ymm
#endif
constexpr int64_t kSerialMacs = 1 << 15;  // below this, one thread: waking the second costs more
constexpr int64_t kDecodedMaxK = 4096;    // a decoded block of NB rows x K floats lives on the stack (64 KB at most)

// A stored scale or min as float: float16 bits widen exactly (subnormals too).
inline float widen(float v) { return v; }
inline float widen(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u | mantissa << 13 : (exponent + 112) << 23 | mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// S: how scales and mins are stored, float, or uint16_t for float16 (where that loses nothing:
// gpu/quant/weight.py `compact`; GGUF's own scales are float16).
template <class S>
struct Weight {
  const uint8_t* q;  // row n's codes at q + n * row_bytes
  int64_t row_bytes;
  const S* scales;  // [N, K / G]
  const S* mins;    // [N, K / G] or null (zero)
  int64_t K, G;

  // Asks for the rows kPrefetchBytes on from block n0's (at least NB on): codes, scales, mins.
  void prefetch_ahead(int64_t n0, int64_t NB) const {
    const int64_t groups = K / G, ahead = n0 + std::max<int64_t>(NB, kPrefetchBytes / row_bytes);
    prefetch_span(q + ahead * row_bytes, NB * row_bytes);
    prefetch_span(scales + ahead * groups, NB * groups);
    if (mins) prefetch_span(mins + ahead * groups, NB * groups);
  }
};

#if !defined(CONVEYOR_INT8)  // quant_int8_isa.h has x86's (v16 is its fvec)
inline float hsum(v16 v) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += v[l];
  return s;
}
#endif

// y[m, n0 + n] = x[m] . w[n0 + n] (+ bias[n0 + n]) for m < MB, n < NB; x rows K apart, y rows ldy.
template <class D, class S, int MB, int NB>
void block(const float* __restrict x, const Weight<S>& w, int64_t n0, const float* __restrict bias,
           float* __restrict y, int64_t ldy) {
  v16 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = v16{};
  const int64_t K = w.K, groups = K / w.G;
  const uint8_t* q = w.q + n0 * w.row_bytes;
  w.prefetch_ahead(n0, NB);
  for (int64_t g = 0; g < groups; ++g) {
    float s[NB], mn[NB];
    for (int n = 0; n < NB; ++n) {
      s[n] = widen(w.scales[(n0 + n) * groups + g]);
      mn[n] = w.mins ? widen(w.mins[(n0 + n) * groups + g]) : 0.f;
    }
    for (int64_t k = g * w.G; k < (g + 1) * w.G; k += D::kInputs) {
      const uint8_t* chunk = q + k / D::kInputs * D::kBytes;
      for (int p = 0; p < D::kParts; ++p) {
        v16 wv[NB][D::kVecs];
        for (int n = 0; n < NB; ++n) {
          D::decode(chunk + n * w.row_bytes, p, wv[n]);
          for (int j = 0; j < D::kVecs; ++j) wv[n][j] = wv[n][j] * s[n] + mn[n];
        }
        for (int m = 0; m < MB; ++m)
          for (int j = 0; j < D::kVecs; ++j) {
            const v16 xv = load16(x + m * K + k + D::offset(p, j));
            for (int n = 0; n < NB; ++n) acc[m][n] += wv[n][j] * xv;
          }
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) y[m * ldy + n0 + n] = hsum(acc[m][n]) + (bias ? bias[n0 + n] : 0.f);
}

// out[r, k] = w[n0 + r, k] as float32 for r < num_rows, in the chunks' input order, on the
// calling thread: each value exactly as block computes it (code * scale + min).
template <class D, class S>
void decode_rows(const Weight<S>& w, int64_t n0, int64_t num_rows, float* __restrict out) {
  const int64_t K = w.K, groups = K / w.G;
  for (int64_t r = 0; r < num_rows; ++r) {
    const uint8_t* q = w.q + (n0 + r) * w.row_bytes;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = widen(w.scales[(n0 + r) * groups + g]), mn = w.mins ? widen(w.mins[(n0 + r) * groups + g]) : 0.f;
      for (int64_t k = g * w.G; k < (g + 1) * w.G; k += D::kInputs)
        for (int p = 0; p < D::kParts; ++p) {
          v16 v[D::kVecs];
          D::decode(q + k / D::kInputs * D::kBytes, p, v);
          for (int j = 0; j < D::kVecs; ++j) store16(out + r * K + k + D::offset(p, j), v[j] * s + mn);
        }
    }
  }
}

// block's product from a decoded buf [NB, K]: the same sums in the same order, so the same bits.
// Its MB + NB vectors a step are pinned in registers (vector_math.h `in_register`).
template <class D, int MB, int NB>
void decoded_block(const float* __restrict x, const float* __restrict buf, int64_t K, int64_t n0,
                   const float* __restrict bias, float* __restrict y, int64_t ldy) {
  v16 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = v16{};
  for (int64_t k = 0; k < K; k += D::kInputs)
    for (int p = 0; p < D::kParts; ++p)
      for (int j = 0; j < D::kVecs; ++j) {
        v16 wv[NB];
        for (int n = 0; n < NB; ++n) wv[n] = in_register(load16(buf + n * K + k + D::offset(p, j)));
        for (int m = 0; m < MB; ++m) {
          const v16 xv = in_register(load16(x + m * K + k + D::offset(p, j)));
          for (int n = 0; n < NB; ++n) acc[m][n] += wv[n] * xv;
        }
      }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) y[m * ldy + n0 + n] = hsum(acc[m][n]) + (bias ? bias[n0 + n] : 0.f);
}

// f(std::integral_constant<int, R>{}) for a pass of R = min(left, kMB) rows of x: the row count as
// a template argument, for block and decoded_block alike.
template <class F>
inline void with_pass_rows(int64_t left, F&& f) {
  switch (std::min<int64_t>(left, kMB)) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
#if defined(__AVX512F__)
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
#else
    default: return f(std::integral_constant<int, 3>{});
#endif
  }
}

// Rows [0, mb) of x against outputs [n0, n0 + nb), nb <= NB: whole blocks of NB, or one by one.
// Where the rows take three passes of kMB or more, a block's rows are decoded once (decode_rows,
// onto the stack) and every pass reads the floats, the same values summed in the same order. A
// SmolLM2 layer's four u4 products, ms, decoded per pass / once (AMD EPYC Zen 5, interleaved, the
// outputs bitwise equal): x86-64-v3 8 rows 0.50 / 0.48, 16 rows 0.99 / 0.81, 32 rows 1.91 / 1.48;
// x86-64-v4 12 rows 0.40 / 0.32, 32 rows 1.02 / 0.69; native 24 rows 0.84 / 0.79, 32 rows 1.11 /
// 1.02. At two passes it lost up to 17% on some builds (native 8 rows 0.29-0.30 / 0.33-0.34).
template <class D, int NB, class S>
void rows(int64_t mb, int64_t nb, const float* x, const Weight<S>& w, int64_t n0, const float* bias, float* y, int64_t ldy) {
  if (mb > 2 * kMB && nb == NB && w.K <= kDecodedMaxK) {
    alignas(64) float buf[NB * kDecodedMaxK];
    for (int64_t n = n0; n < n0 + nb; n += NB) {
      w.prefetch_ahead(n, NB);
      decode_rows<D>(w, n, NB, buf);
      for (int64_t m0 = 0; m0 < mb; m0 += kMB) {
        const float* xm = x + m0 * w.K;
        float* ym = y + m0 * ldy;
        with_pass_rows(mb - m0, [&](auto r) { decoded_block<D, decltype(r)::value, NB>(xm, buf, w.K, n, bias, ym, ldy); });
      }
    }
    return;
  }
  for (int64_t m0 = 0; m0 < mb; m0 += kMB) {
    const float* xm = x + m0 * w.K;
    float* ym = y + m0 * ldy;
    for (int64_t n = n0; n < n0 + nb; n += (nb == NB ? NB : 1))
      with_pass_rows(mb - m0, [&](auto r) {
        constexpr int R = decltype(r)::value;
        nb == NB ? block<D, S, R, NB>(xm, w, n, bias, ym, ldy) : block<D, S, R, 1>(xm, w, n, bias, ym, ldy);
      });
  }
}

template <class D, class S>
void direct(const float* x, const Weight<S>& w, const float* bias, float* y, int64_t M, int64_t N) {
  const int64_t num_blocks = (N + kNB - 1) / kNB;
#pragma omp parallel for schedule(static) if (M * N * w.K > kSerialMacs)
  for (int64_t b = 0; b < num_blocks; ++b) rows<D, kNB>(M, std::min<int64_t>(kNB, N - b * kNB), x, w, b * kNB, bias, y, N);
}

// out[r, k] = w[n0 + r, k] as float32, for r < num_rows, rows spread over threads.
template <class D, class S>
void dequantize(const Weight<S>& w, int64_t n0, int64_t num_rows, float* __restrict out) {
#pragma omp parallel for schedule(static) if (num_rows * w.K > kSerialMacs)
  for (int64_t r = 0; r < num_rows; ++r) decode_rows<D>(w, n0 + r, 1, out + r * w.K);
}

#if defined(CONVEYOR_INT8)
#if defined(__AVX512F__)
constexpr int kI8MB = 4, kI8NB = 2, kI8NB1 = 4;
#else
constexpr int kI8MB = 2, kI8NB = 2, kI8NB1 = 2;
#endif

// All M rows of x against outputs [n0, n0 + nb), nb <= NB.
template <bool U4, int P, int NB, class S>
void int8_rows(const QuantizedX& xq, const Weight<S>& w, int64_t nb, int64_t n0, const float* bias, float* y, int64_t N) {
  for (int64_t m0 = 0; m0 < xq.M; m0 += kI8MB) {
    float* ym = y + m0 * N;
    for (int64_t n = n0; n < n0 + nb; n += (nb == NB ? NB : 1)) {
#define CONVEYOR_ROWS(R)                                                                   \
  (nb == NB ? int8_block<U4, P, R, NB>(xq, w.q, w.scales, w.mins, m0, n, bias, ym, N) \
            : int8_block<U4, P, R, 1>(xq, w.q, w.scales, w.mins, m0, n, bias, ym, N))
      switch (std::min<int64_t>(xq.M - m0, kI8MB)) {
        case 1: CONVEYOR_ROWS(1); break;
#if defined(__AVX512F__)
        case 2: CONVEYOR_ROWS(2); break;
        case 3: CONVEYOR_ROWS(3); break;
        default: CONVEYOR_ROWS(4); break;
#else
        default: CONVEYOR_ROWS(2); break;
#endif
      }
#undef CONVEYOR_ROWS
    }
  }
}

template <bool U4, int P, class S>
void int8_path(const float* x, const Weight<S>& w, const float* bias, float* y, int64_t M, int64_t N) {
  static thread_local QuantizedX buffers;  // the caller's: kept between calls, not reallocated
  QuantizedX& xq = buffers;                // (a reference, so every OpenMP thread reads the caller's)
  xq.build(x, M, w.K, w.G, U4, P);
  const int NB = M == 1 ? kI8NB1 : kI8NB;
  const int64_t num_blocks = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static) if (M * N * w.K > kSerialMacs)
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t n0 = b * NB, nb = std::min<int64_t>(NB, N - n0);
    if (NB == kI8NB1)
      int8_rows<U4, P, kI8NB1>(xq, w, nb, n0, bias, y, N);
    else
      int8_rows<U4, P, kI8NB>(xq, w, nb, n0, bias, y, N);
  }
}

// y [M, count] = x W[rows]^T on the int8 path: for each row, its outputs as the full product
// computes them. An output's sums do not depend on its neighbours' (int8_block: one accumulator
// set per row; store_sums' four-row tree pairs the lanes as the one-row one does), so a few rows
// of a wide product (quant_argmax.py's candidates) need neither a copy of their codes nor the rest:
// each is int8_rows' block of one, on a Weight that starts at it and writes column i.
template <bool U4, int P, class S>
void int8_subset(const float* x, const Weight<S>& w, const int32_t* rows, int64_t count, float* y, int64_t M) {
  static thread_local QuantizedX buffers;  // as int8_path's
  QuantizedX& xq = buffers;
  xq.build(x, M, w.K, w.G, U4, P);
  const int64_t groups = w.K / w.G;
#pragma omp parallel for schedule(static) if (M * count * w.K > kSerialMacs)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = rows[i];
    const S* mins = w.mins ? w.mins + n * groups : nullptr;
    const Weight<S> row = {w.q + n * w.row_bytes, w.row_bytes, w.scales + n * groups, mins, w.K, w.G};
    int8_rows<U4, P, 1>(xq, row, 1, 0, nullptr, y + i, count);
  }
}

// int8_subset for a kind (u4 or u8) and a plane count (1 to 3) known at run time.
template <class S>
void int8_subset_planes(const Weight<S>& w, bool u4, int64_t planes, const float* x, const int32_t* rows,
                        int64_t count, float* y, int64_t M) {
  switch (planes) {
    case 1: return u4 ? int8_subset<true, 1>(x, w, rows, count, y, M) : int8_subset<false, 1>(x, w, rows, count, y, M);
    case 2: return u4 ? int8_subset<true, 2>(x, w, rows, count, y, M) : int8_subset<false, 2>(x, w, rows, count, y, M);
    default: return u4 ? int8_subset<true, 3>(x, w, rows, count, y, M) : int8_subset<false, 3>(x, w, rows, count, y, M);
  }
}

// x quantized to `planes` int8 planes (quant_int8.h).
template <bool U4, class S>
void int8_planes(int64_t planes, const float* x, const Weight<S>& w, const float* bias, float* y, int64_t M, int64_t N) {
  switch (planes) {
    case 1: return int8_path<U4, 1>(x, w, bias, y, M, N);
    case 2: return int8_path<U4, 2>(x, w, bias, y, M, N);
    default: return int8_path<U4, 3>(x, w, bias, y, M, N);
  }
}
#endif

enum Kind { kU4 = 0, kU8 = 1, kE4M3 = 2 };
enum Path { kDirect = 0, kInt8 = 2 };  // kInt8 + p - 1: x in p int8 planes (1 to 3)

}  // namespace

extern "C" {

// A weight as the caller keeps it (quant_linear.py's _WeightArgs): the codes q ([N, K / 2] u4,
// [N, K] u8 or e4m3), scales and mins [N, K / G] (mins may be null), float32, or float16 where
// half_scales. kind: 0 u4 (G % 32 == 0), 1 u8, 2 e4m3 (G % 16 == 0); the caller checks.
struct WeightArgs {
  const uint8_t* q;
  const void* scales;
  const void* mins;
  int64_t K, N, G, kind, half_scales;
};

}  // extern "C"

namespace {

template <class S>
Weight<S> weight_of(const WeightArgs* a) {
  return {a->q, a->kind == kU4 ? a->K / 2 : a->K, static_cast<const S*>(a->scales), static_cast<const S*>(a->mins), a->K, a->G};
}

template <class S>
void quant_linear(const float* x, float* y, int64_t M, int64_t path, const float* bias, const WeightArgs* args) {
  const int64_t N = args->N, kind = args->kind;
  const Weight<S> w = weight_of<S>(args);
#if defined(CONVEYOR_INT8)
  if (path >= kInt8 && kind != kE4M3) {
    const int64_t planes = path - kInt8 + 1;
    return kind == kU4 ? int8_planes<true>(planes, x, w, bias, y, M, N) : int8_planes<false>(planes, x, w, bias, y, M, N);
  }
#else
  (void)path;
#endif
  switch (kind) {
    case kU4: return direct<U4>(x, w, bias, y, M, N);
    case kU8: return direct<U8>(x, w, bias, y, M, N);
    default: return direct<E4M3>(x, w, bias, y, M, N);
  }
}

template <class S>
void dequantize_rows(float* out, int64_t n0, int64_t num_rows, const WeightArgs* args) {
  const Weight<S> w = weight_of<S>(args);
  switch (args->kind) {
    case kU4: return dequantize<U4>(w, n0, num_rows, out);
    case kU8: return dequantize<U8>(w, n0, num_rows, out);
    default: return dequantize<E4M3>(w, n0, num_rows, out);
  }
}

}  // namespace

extern "C" {

// x [M, K] float32 -> y [M, N] = x W^T (+ bias [N], or null). path: 0 direct, 2 + p - 1 int8
// with x in p planes, p <= 3 (u4 and u8, where the build has AVX2; otherwise direct).
void conveyor_quant_linear_f32(const float* x, float* y, int64_t M, int64_t path, const float* bias,
                               const WeightArgs* args) {
  if (args->half_scales) return quant_linear<uint16_t>(x, y, M, path, bias, args);
  return quant_linear<float>(x, y, M, path, bias, args);
}

// out [num_rows, K] float32 = rows [n0, n0 + num_rows) of W.
void conveyor_quant_dequantize_f32(float* out, int64_t n0, int64_t num_rows, const WeightArgs* args) {
  if (args->half_scales) return dequantize_rows<uint16_t>(out, n0, num_rows, args);
  return dequantize_rows<float>(out, n0, num_rows, args);
}

// y [M, count] = x W[rows]^T for `rows` [count] int32 in [0, N): each output as path `path`
// (int8 with 1 to 3 planes, u4 or u8) gives it in the full product. Returns 0, or -1 where this
// build or weight has no such path (the caller multiplies a copy of the rows instead).
int64_t conveyor_quant_linear_subset_f32(const float* x, float* y, int64_t M, int64_t path, const int32_t* rows,
                                         int64_t count, const WeightArgs* args) {
#if defined(CONVEYOR_INT8)
  if (path < kInt8 || path > kInt8 + 2 || args->kind == kE4M3) return -1;
  if (args->half_scales)
    int8_subset_planes(weight_of<uint16_t>(args), args->kind == kU4, path - kInt8 + 1, x, rows, count, y, M);
  else
    int8_subset_planes(weight_of<float>(args), args->kind == kU4, path - kInt8 + 1, x, rows, count, y, M);
  return 0;
#else
  (void)x, (void)y, (void)M, (void)path, (void)rows, (void)count, (void)args;
  return -1;
#endif
}

// Whether path 2 (int8) exists in this build: 0 no; 1 its byte products by vpmaddubsw + vpmaddwd;
// 2 by a VNNI dot product (vpdpbusd).
int64_t conveyor_quant_linear_has_int8() {
#if defined(CONVEYOR_INT8)
  return kVnni ? 2 : 1;
#else
  return 0;
#endif
}

// The int8 path's vectors in 32-bit lanes: 16 (zmm, AVX-512 F and BW) or 8 (ymm); 0 without it.
int64_t conveyor_quant_linear_int8_lanes() {
#if defined(CONVEYOR_INT8)
  return kIntLanes;
#else
  return 0;
#endif
}

}  // extern "C"

// Their packed forms, for recorded programs (packed_call.h).
CONVEYOR_PACKED(conveyor_quant_linear_f32)
CONVEYOR_PACKED(conveyor_quant_dequantize_f32)

namespace {

// out[t] = row ids[t] of W, each decoded by `dequantize`'s own loop (the same values as
// conveyor_quant_dequantize_f32 gives that row); an id outside [0, N) gives zeros.
template <class D, class S>
void gather_rows(const Weight<S>& w, const int64_t* ids, int64_t T, int64_t N, float* out) {
#pragma omp parallel for schedule(static) if (T * w.K > kSerialMacs)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = ids[t];
    if (n >= 0 && n < N)
      dequantize<D>(w, n, 1, out + t * w.K);  // one row: serial (or nested, one thread) inside this loop
    else
      std::memset(out + t * w.K, 0, w.K * sizeof(float));
  }
}

template <class S>
void quant_rows(float* out, const int64_t* ids, int64_t T, const WeightArgs* args) {
  const Weight<S> w = weight_of<S>(args);
  switch (args->kind) {
    case kU4: return gather_rows<U4>(w, ids, T, args->N, out);
    case kU8: return gather_rows<U8>(w, ids, T, args->N, out);
    default: return gather_rows<E4M3>(w, ids, T, args->N, out);
  }
}

}  // namespace

extern "C" {

// out [T, K] float32 = rows ids[t] of W ([T] int64): a quantized embedding table's lookup.
void conveyor_quant_rows_f32(float* out, const int64_t* ids, int64_t T, const WeightArgs* args) {
  if (args->half_scales) return quant_rows<uint16_t>(out, ids, T, args);
  return quant_rows<float>(out, ids, T, args);
}

}  // extern "C"

CONVEYOR_PACKED(conveyor_quant_rows_f32)
