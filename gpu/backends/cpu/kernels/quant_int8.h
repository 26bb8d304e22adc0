// The int8 path of quant_linear.cpp, for steps of few rows: x quantized to int8 in blocks of 32
// inputs (a scale each, as llama.cpp's Q8_1), the weight's u4 / u8 codes multiplied by it as
// bytes (quant_int8_isa.h: one vpdpbusd per 64 byte products with VNNI). A code costs about a
// twentieth of an instruction where decoding it to float costs a third (quant_decode.h), so a
// one-row step can read its weights as fast as memory streams them.
//
//   y[m, n] = sum_v sum_lanes cvt(isum[lane]) * dx[m, block(lane)] * s[n, group(lane)]
//             + sum_g mins[n, g] * xsum[m, g]
// with xsum[m, g] the sum over group g of x as quantized (codes times their block's scale), once
// per call for all N outputs. That sum, not x's own, makes the result exactly W x' for x' the
// quantized x: the rounding errors meet w (centred on 0) rather than the codes' part of it (all
// of one sign where the mins are large: twice the error, measured). |x' - x| is at most half a
// step of its block's max / 127.
//
// A vector of codes (kVecBytes bytes) gives kIntLanes int32 lanes of 4-product sums; every lane
// lies in one block of x and one group of W and is scaled on its own (a VecPlan says which),
// before one horizontal sum per output. u4: a vector holds kVecBytes / 16 chunks; `& 15` gives
// the inputs 0..15 of each, `>> 4` inputs 16..31, and x is laid out to match. u8 without VNNI:
// (code - 128) * x in vpmaddubsw's signed operand cannot saturate, and 128 * x joins the mins.

#pragma once

#include "quant_int8_isa.h"
#include "vector_math.h"

#if defined(CONVEYOR_INT8)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <new>
#include <tuple>
#include <vector>

namespace {

constexpr int kBlock = 32;                 // inputs per x scale

// Which scales the lanes of one vector of codes take: lane l, group base + lane_group[l]. Every
// vector reads the same number of scales, scale_lanes(K / G), from `base`: its first group, moved
// back where that would read past the row. So a row of kIntLanes groups or more has whole-vector
// scale loads, unmasked, and a shorter one reads all its scales each time, by masks made once per
// call. (Masks made per vector cost a tenth of an AVX2 u4 call, measured: that loop is bound by
// its uops.)
struct alignas(64) VecPlan {
  int32_t lane_group[kIntLanes];  // < scale_lanes
  int32_t lane_block[kIntLanes];  // x's block, -1 past K
  int64_t base, code_bytes;       // first group read, bytes of codes (less at K's end)
};

inline int scale_lanes(int64_t num_groups) { return static_cast<int>(std::min<int64_t>(kIntLanes, num_groups)); }

// The plan for rows of K inputs in groups of G, cached by shape (a model has a handful).
const std::vector<VecPlan>& plan_for(int64_t K, int64_t G, bool u4) {
  static thread_local std::map<std::tuple<int64_t, int64_t, bool>, std::vector<VecPlan>> plans;
  std::vector<VecPlan>& plan = plans[{K, G, u4}];
  if (!plan.empty()) return plan;
  const int64_t vec_inputs = u4 ? 2 * kVecBytes : kVecBytes, row_bytes = u4 ? K / 2 : K;
  plan.resize((K + vec_inputs - 1) / vec_inputs);
  for (int64_t v = 0; v < static_cast<int64_t>(plan.size()); ++v) {
    VecPlan& p = plan[v];
    // Each lane's inputs lie in one group, so the vector's groups number at most kIntLanes (and
    // K / G): they lie in [base, base + scale_lanes).
    p.base = std::min(v * vec_inputs / G, K / G - scale_lanes(K / G));
    for (int l = 0; l < kIntLanes; ++l) {
      const int64_t k = v * vec_inputs + (u4 ? l / 4 * 32 : 4 * l);  // the lane's first input
      const int64_t group = std::min(k, K - 1) / G;  // a lane past K takes any scale: it adds 0
      p.lane_group[l] = static_cast<int32_t>(group - p.base);
      p.lane_block[l] = k < K ? static_cast<int32_t>(k / kBlock) : -1;
    }
    p.code_bytes = std::min<int64_t>(kVecBytes, row_bytes - v * kVecBytes);
  }
  return plan;
}

// A std::vector's storage on cache lines of its own. x's planes are read a vector (up to 64
// bytes) at a time: from malloc's 16-byte alignment, zmm loads straddled two lines in some
// processes and not others, and the int8 path's time with them (a SmolLM2 layer at 8 rows, native
// build: 0.26 or 0.33 ms by the process).
template <class T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(kLineBytes))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(kLineBytes)); }
  template <class U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <class T>
using LineVector = std::vector<T, LineAligned<T>>;

// x of one call, quantized and laid out as the vectors of codes meet it. Built once per call
// by the calling thread, read by all.
struct QuantizedX {
  int64_t M, K, G, planes, num_groups, num_vecs, xvec_bytes, xvec_stride, group_stride;
  bool u4, shifted;  // shifted: u8 codes are multiplied as code - 128 (no VNNI)
  const VecPlan* plan;
  LineVector<int8_t> q;    // [M, num_vecs, planes, xvec_bytes]; u4: the low nibbles' x, then the high's
  LineVector<float> dx;    // [M, num_vecs, kIntLanes]: each lane's last plane's scale, 0 past K
  LineVector<float> xsum;  // [M, group_stride]: quantized x summed over each group, 0-padded

  void build(const float* x, int64_t rows, int64_t k, int64_t g, bool is_u4, int num_planes) {
    M = rows, K = k, G = g, u4 = is_u4, shifted = !kVnni && !u4, planes = num_planes;
    const std::vector<VecPlan>& p = plan_for(K, G, u4);
    plan = p.data(), num_vecs = static_cast<int64_t>(p.size());
    xvec_bytes = u4 ? 2 * kVecBytes : kVecBytes;
    xvec_stride = planes * xvec_bytes;
    num_groups = K / G;
    group_stride = (num_groups + kIntLanes - 1) / kIntLanes * kIntLanes;
    q.resize(M * num_vecs * xvec_stride);  // past K: never read against a nonzero code
    dx.resize(M * num_vecs * kIntLanes);
    xsum.assign(M * group_stride, 0.f);
    std::vector<float> scale((K + kBlock - 1) / kBlock);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t b0 = 0; b0 < K; b0 += kBlock) quantize_block(x + m * K, m, b0, scale.data());
      for (int64_t v = 0; v < num_vecs; ++v)
        for (int l = 0; l < kIntLanes; ++l) {
          const int32_t b = plan[v].lane_block[l];
          dx[(m * num_vecs + v) * kIntLanes + l] = b < 0 ? 0.f : scale[b];
        }
    }
  }

 private:
  // Inputs [b0, b0 + 32) of row m (16 at K's end of a u8 row of K = 16 mod 32), plane by plane:
  // each plane's codes are the rounded remainder of the ones before, at 1/128 of their step.
  // Each vector of kIntLanes inputs lands as one run of bytes, in one group.
  void quantize_block(const float* x, int64_t m, int64_t b0, float* scale) {
    const int num = static_cast<int>(std::min<int64_t>(kBlock, K - b0)) / kIntLanes;
    fvec rest[kBlock / kIntLanes];
    float amax = 0.f;
    for (int j = 0; j < num; ++j) rest[j] = load_fvec(x + b0 + j * kIntLanes), amax = std::max(amax, max_abs(rest[j]));
    float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t* row = q.data() + m * num_vecs * xvec_stride + b0 / (u4 ? 2 * kVecBytes : kVecBytes) * xvec_stride;
    float* sums = xsum.data() + m * group_stride;
    for (int64_t plane = 0; plane < planes; ++plane, d *= 1.f / 128.f, inv *= 128.f) {
      for (int j = 0; j < num; ++j) {
        const int k = j * kIntLanes;  // u4: inputs 0..15 of the chunk with the low nibbles, 16..31 the high
        const int64_t at = u4 ? (k < 16 ? 0 : kVecBytes) + b0 % (2 * kVecBytes) / 2 + k % 16 : b0 % kVecBytes + k;
        const ivec c = round_to_int(rest[j] * inv);  // |c| <= 127: the remainders are at most half a step
        rest[j] -= cvt(c) * d;
        store_int8(row + plane * xvec_bytes + at, c);
        sums[(b0 + k) / G] += d * static_cast<float>(sum_ints(c));
      }
    }
    scale[b0 / kBlock] = d * 128.f;  // the last plane's step: integer sums over the planes are in its units
  }
};

// The codes of one row's vector as bytes: u4 as (inputs 0..15, inputs 16..31) of each chunk.
struct Codes {
  ivec lo, hi;
};

template <bool U4>
inline Codes load_codes(const uint8_t* p, int64_t n) {
  const ivec raw = load_bytes(p, n);
  if (U4) return {and_(raw, bytes(15)), and_(srl4(raw), bytes(15))};
  if (kVnni) return {raw, raw};
  return {xor_(raw, bytes(0x80)), raw};  // code - 128 as a signed byte (see the header)
}

// u4 without VNNI: a plane's low and high nibbles' pair sums meet as 16 bits (|sum| at most
// 2 * 2 * 15 * 127 = 7620, no saturation) and widen once, weighted by the plane's worth in place of
// the shifts (2 * 7620 * 128^2 < 2^31): 14 instructions for three planes where emulated dot
// products take 20, for the same integers.
template <int P>
inline ivec dot_u4_pairs(const Codes& c, const int8_t* xq, int64_t plane_bytes) {
  static_assert(P >= 1 && P <= 3, "a plane's worth, 128^(P-1-p), must fit in 16 bits");
  ivec acc = ivec{};
  for (int p = 0; p < P; ++p, xq += plane_bytes) {
    const ivec pairs = add16(pair_sums(c.lo, load_ivec(xq)), pair_sums(c.hi, load_ivec(xq + kVecBytes)));
    const ivec part = widen(pairs, static_cast<int16_t>(1 << (7 * (P - 1 - p))));
    acc = p ? add32(acc, part) : part;
  }
  return acc;
}

// The lanes' sums of codes times x's planes, in units of the last plane's step: each plane is
// worth 128 of the next. At most 127 * (128^2 + 128 + 1) * 4 * 255 < 2^31 for u8 (4 codes a
// lane; 8 codes of at most 15 for u4): no plane count the kernel takes can overflow.
template <bool U4, int P>
inline ivec dot_codes(const Codes& c, const int8_t* xq, int64_t plane_bytes) {
  if constexpr (U4 && !kVnni) return dot_u4_pairs<P>(c, xq, plane_bytes);
  ivec acc = ivec{};
  for (int p = 0; p < P; ++p, xq += plane_bytes) {
    if (p) acc = sll7(acc);
    const ivec x0 = load_ivec(xq);
    if (U4)
      acc = dot(dot(acc, c.lo, x0), c.hi, load_ivec(xq + kVecBytes));
    else if (kVnni)
      acc = dot(acc, c.lo, x0);
    else
      acc = dot(acc, abs8(c.lo), sign_of(x0, c.lo));
  }
  return acc;
}

// Sums of accs[i] into out[i] (+ bias[i]), four at a time.
inline void store_sums(const fvec* accs, int count, const float* bias, float* out, int64_t stride) {
  int i = 0;
  for (; i + 4 <= count; i += 4) {
    alignas(16) float s[4];
    _mm_store_ps(s, hsum4(accs[i], accs[i + 1], accs[i + 2], accs[i + 3]));
    for (int j = 0; j < 4; ++j) out[(i + j) * stride] = s[j] + (bias ? bias[(i + j) * stride] : 0.f);
  }
  for (; i < count; ++i) out[i * stride] = hsum(accs[i]) + (bias ? bias[i * stride] : 0.f);
}

// y[m, n0 + n] for m < MB (x's rows m0...), n < NB; y points at row m0.
template <bool U4, int P, int MB, int NB, class S>
void int8_block(const QuantizedX& xq, const uint8_t* q, const S* scales, const S* mins, int64_t m0,
                int64_t n0, const float* bias, float* y, int64_t ldy) {
  fvec acc[NB][MB];
  for (int n = 0; n < NB; ++n)
    for (int m = 0; m < MB; ++m) acc[n][m] = fvec{};
  const int64_t groups = xq.num_groups, row_bytes = U4 ? xq.K / 2 : xq.K;
  const int64_t ahead = std::max<int64_t>(NB, kPrefetchBytes / row_bytes) * row_bytes;  // bytes
  const int64_t x_row = xq.num_vecs * xq.xvec_stride, dx_row = xq.num_vecs * kIntLanes;
  const int8_t* xv = xq.q.data() + m0 * x_row;
  const float* dv = xq.dx.data() + m0 * dx_row;
  q += n0 * row_bytes, scales += n0 * groups, mins = mins ? mins + n0 * groups : nullptr;
  prefetch_span(scales + ahead / row_bytes * groups, NB * groups);
  if (mins) prefetch_span(mins + ahead / row_bytes * groups, NB * groups);
  const VecPlan* plan = xq.plan;
  const FirstLanes vec_scales(scale_lanes(groups));  // read per vector of codes, from plan->base
  for (const uint8_t* codes = q; codes < q + row_bytes; codes += kVecBytes, xv += xq.xvec_stride, dv += kIntLanes, ++plan) {
    const ivec idx = load_ivec(plan->lane_group);
    const S* s0 = scales + plan->base;
    for (int n = 0; n < NB; ++n) {
      _mm_prefetch(reinterpret_cast<const char*>(codes + n * row_bytes + ahead), _MM_HINT_T0);
      const Codes c = load_codes<U4>(codes + n * row_bytes, plan->code_bytes);
      const fvec s = permute(idx, load_scales(s0 + n * groups, vec_scales));
      for (int m = 0; m < MB; ++m)
        acc[n][m] = cvt(dot_codes<U4, P>(c, xv + m * x_row, xq.xvec_bytes)) * load_fvec(dv + m * dx_row) * s + acc[n][m];
    }
  }
  for (int64_t g = 0; g < groups; g += kIntLanes) {  // the mins' (and the u8 shift's) part
    const FirstLanes width(static_cast<int>(std::min<int64_t>(kIntLanes, groups - g)));
    for (int n = 0; n < NB; ++n) {
      fvec mn = mins ? load_scales(mins + n * groups + g, width) : fvec{};
      if (xq.shifted) mn += load_scales(scales + n * groups + g, width) * 128.f;
      for (int m = 0; m < MB; ++m) acc[n][m] += mn * load_fvec(&xq.xsum[(m0 + m) * xq.group_stride + g]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    fvec row[NB];
    for (int n = 0; n < NB; ++n) row[n] = acc[n][m];
    store_sums(row, NB, bias ? bias + n0 : nullptr, y + m * ldy + n0, 1);
  }
}

}  // namespace

#endif  // CONVEYOR_INT8
