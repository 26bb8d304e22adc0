// Paged attention's decode path: one query token, every head, streamed through its context
// with an online softmax (paged_attention.cpp says the cache layout and the rows). KV is the
// cache's element: float, or uint8_t for fp8 e4m3 codes (read by vector_math.h's overloads).

#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "vector_math.h"

namespace {

constexpr int kMaxBlock = 256;
constexpr int kPrefetchBlocks = 2;  // how far ahead in a block table to prefetch

inline void prefetch_line(const void* base, int64_t line) {
  __builtin_prefetch(static_cast<const char*>(base) + line * kLineBytes, 0, 1);
}

// H query heads sharing a kv head against one (block, kv head) tile, when BS and D are
// compile-time multiples of kLanes: each head's scores of the block's keys, the online-softmax
// update of its (m, l), and the value update of its accumulator a [D]. q, a: the heads' D floats
// each, one after the other; m, l: H each; p: H rows of kMaxBlock scratch.
//
// What made the plain loops (kept below for other shapes) slow:
//  - Prefetching a whole block ahead in one burst of 256 lines filled the core's miss buffers,
//    so the burst stalled the arithmetic and the arithmetic then left memory idle. Here the
//    caller names the same tile of a later block (pk, pv; null: nothing to fetch): its K lines
//    are requested a few at a time between the score FMAs and its V lines (half the tile)
//    before the value update, so loads and arithmetic overlap.
//  - One query head at a time. Each head re-read the tile (the compiler folds a load into every
//    FMA), its scores were four chains of D / 4 dependent FMAs, its max a scalar chain of BS,
//    and the softmax's correction a call to expf, around which every vector register spilled.
//    The heads of a group are independent, so here they run side by side: each K and V vector
//    loaded once into a register for all H, H x NB x U score chains (U partial sums: at least
//    eight chains, two FMA ports times the FMA's latency), H x kWidth value chains, each head's
//    max a reduction tree, the correction inline. SmolLM2's one-row decode program (3 query
//    heads a kv head, 128-177 keys): its attention 0.65-0.68 -> 0.42-0.48 ms a step.
// KV types the later tile (the cache's element: it sets how many lines to prefetch); the tile
// itself is floats (an fp8 one widened by the caller).
template <int BS, int D, int H, typename KV>
inline void attend_heads(const float* __restrict q, const float* __restrict kt, const float* __restrict vt, int i0,
                         int i1, float* __restrict a, float* __restrict m, float* __restrict l, float* __restrict p,
                         const KV* pk, const KV* pv, float softcap) {
  constexpr int NB = BS / kLanes, ND = D / kLanes;
  constexpr int kLines = BS * D * static_cast<int>(sizeof(KV)) / kLineBytes;  // lines in a K (or V) tile
  // Partial sums a score vector: at least 8 chains in all, two FMA ports times the FMA's latency.
  constexpr int U = H * NB >= 8 ? 1 : H * NB >= 4 ? 2 : H * NB >= 2 ? 4 : 8;
  // Value accumulators held at once, H x kWidth: at most half the vector registers (32 with
  // AVX-512, 16 with AVX2), kWidth a power of two so that it divides ND (loops of fixed length
  // keep the accumulators in registers).
  constexpr int kBudget = (kLanes == 16 ? 16 : 8) / H;
  constexpr int kWidth = std::min(ND, kBudget >= 8 ? 8 : kBudget >= 4 ? 4 : kBudget >= 2 ? 2 : 1);
  static_assert(ND % kWidth == 0, "the value update steps kWidth vectors");
  static_assert(D % U == 0, "the score loop steps U dimensions");
  v16 s[H][NB][U];
  for (int h = 0; h < H; ++h)
    for (int nb = 0; nb < NB; ++nb)
      for (int u = 0; u < U; ++u) s[h][nb][u] = v16{};
  for (int e = 0; e < D; e += U) {
    if (pk) {  // kLines / D * U lines of the later K tile per step of U dimensions
      for (int c = e * kLines / D; c < (e + U) * kLines / D; ++c) prefetch_line(pk, c);
    }
    for (int u = 0; u < U; ++u)
      for (int nb = 0; nb < NB; ++nb) {
        const v16 k = in_register(load16(kt + (e + u) * BS + nb * kLanes));  // one load for the H heads
        for (int h = 0; h < H; ++h) s[h][nb][u] += q[h * D + e + u] * k;
      }
  }
  const bool full = i0 == 0 && i1 == BS;
  vi16 lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  float correction[H];
  for (int h = 0; h < H; ++h) {
    v16 scores[NB], top = v16{} + kNegBig;
    for (int nb = 0; nb < NB; ++nb) {
      v16 sv = s[h][nb][0];
      for (int u = 1; u < U; ++u) sv += s[h][nb][u];
      if (softcap > 0.f) sv = softcap16(sv, softcap);
      if (!full) {
        const vi16 at = lane + nb * kLanes;
        sv = (at >= i0 && at < i1) ? sv : v16{} + kNegBig;
      }
      scores[nb] = sv;
      top = top > sv ? top : sv;
    }
    const float new_m = std::max(m[h], max_lanes(top));
    correction[h] = exp16(v16{} + (m[h] - new_m))[0];  // inline: a call to expf spills every vector register
    v16 sum = v16{};
    for (int nb = 0; nb < NB; ++nb) {
      const v16 e = exp16(scores[nb] - new_m);  // masked lanes: exactly 0
      store16(p + h * kMaxBlock + nb * kLanes, e);
      sum += e;
    }
    l[h] = l[h] * correction[h] + sum_lanes(sum);
    m[h] = new_m;
  }
  if (pv) {
    for (int c = 0; c < kLines; ++c) prefetch_line(pv, c);
  }
  const int lo = full ? 0 : i0, hi = full ? BS : i1;
  for (int d0 = 0; d0 < ND; d0 += kWidth) {
    v16 acc[H][kWidth];
    for (int h = 0; h < H; ++h)
      for (int dv = 0; dv < kWidth; ++dv) acc[h][dv] = load16(a + h * D + (d0 + dv) * kLanes) * correction[h];
    for (int i = lo; i < hi; ++i)
      for (int dv = 0; dv < kWidth; ++dv) {
        const v16 v = in_register(load16(vt + i * D + (d0 + dv) * kLanes));
        for (int h = 0; h < H; ++h) acc[h][dv] += p[h * kMaxBlock + i] * v;
      }
    for (int h = 0; h < H; ++h)
      for (int dv = 0; dv < kWidth; ++dv) store16(a + h * D + (d0 + dv) * kLanes, acc[h][dv]);
  }
}

// Query heads a tile pass takes at once, n = 1..kMaxHeads at run time: four where a vector is a
// register (AVX-512's 32 zmm, AVX2's 16 ymm), else one (a v16 of 8 floats is two SSE or NEON
// registers, and a baseline x86-64 build of four heads ran 1.3x slower than of one).
#if defined(__AVX2__)
constexpr int kMaxHeads = 4;
#else
constexpr int kMaxHeads = 1;
#endif
template <int BS, int D, typename KV>
inline void attend_heads_n(int n, const float* q, const float* kt, const float* vt, int i0, int i1, float* a, float* m,
                           float* l, float* p, const KV* pk, const KV* pv, float softcap) {
  if constexpr (kMaxHeads == 4) {
    switch (n) {
      case 1: return attend_heads<BS, D, 1, KV>(q, kt, vt, i0, i1, a, m, l, p, pk, pv, softcap);
      case 2: return attend_heads<BS, D, 2, KV>(q, kt, vt, i0, i1, a, m, l, p, pk, pv, softcap);
      case 3: return attend_heads<BS, D, 3, KV>(q, kt, vt, i0, i1, a, m, l, p, pk, pv, softcap);
      default: return attend_heads<BS, D, 4, KV>(q, kt, vt, i0, i1, a, m, l, p, pk, pv, softcap);
    }
  }
  return attend_heads<BS, D, 1, KV>(q, kt, vt, i0, i1, a, m, l, p, pk, pv, softcap);
}

// One query token, every head, over its keys [lo, hi): q [Hq, D] pre-scaled -> acc [Hq, D] (the
// output before its division), m and l [Hq] (the running max, the sum of exponentials), which
// merge_parts turns into the output. Query heads h * group .. h * group + group - 1 read kv head
// h. A block's tiles for all heads are adjacent, so the token walks its keys as one stream of
// whole blocks. BS and D are compile-time where specialised (0: read the runtime value). A long
// context is walked in parts, on several threads, and the parts merged (paged_attention.cpp).
template <int BS, int D, typename KV>
void attend_part(const float* __restrict q, const KV* __restrict k_cache,
                 const KV* __restrict v_cache, const int32_t* __restrict table, int64_t lo,
                 int64_t hi, int bs_rt, int d_rt, int num_kv_heads, int group,
                 float* __restrict acc /* [Hq, D] */, float* __restrict s /* [Hq, kMaxBlock] */,
                 float* __restrict m, float* __restrict l /* [Hq] each */, float softcap) {
  const int bs = BS > 0 ? BS : bs_rt;
  const int d = D > 0 ? D : d_rt;
  const int num_heads = num_kv_heads * group;
  const int64_t tile = static_cast<int64_t>(bs) * d;
  const int64_t block_stride = num_kv_heads * tile;
  for (int h = 0; h < num_heads; ++h) {
    m[h] = kNegBig;
    l[h] = 0.f;
  }
  std::fill(acc, acc + num_heads * d, 0.f);

  for (int64_t first = lo - lo % bs; first < hi; first += bs) {
    const int64_t block = table[first / bs];
    const int64_t ahead =  // offset of the block kPrefetchBlocks on, or -1
        first + kPrefetchBlocks * bs < hi ? table[first / bs + kPrefetchBlocks] * block_stride : -1;
    // valid lanes [i0, i1) of this block: the window's start and the query's own position.
    const int i0 = static_cast<int>(std::max<int64_t>(lo - first, 0));
    const int i1 = static_cast<int>(std::min<int64_t>(hi - first, bs));
    for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
      const KV* kt = k_cache + block * block_stride + kvh * tile;  // [D, bs]
      const KV* vt = v_cache + block * block_stride + kvh * tile;  // [bs, D]
      if constexpr (BS > 0 && D > 0 && BS % kLanes == 0 && D % kLanes == 0) {
        const KV* pk = ahead >= 0 ? k_cache + ahead + kvh * tile : nullptr;
        const KV* pv = ahead >= 0 ? v_cache + ahead + kvh * tile : nullptr;
        // An fp8 tile is widened once, into L1, for the group's query heads to share: converted
        // per head, SmolLM2's 3 heads per kv head made decode slower than the float32 cache's.
        alignas(64) float kbuf[std::is_same_v<KV, float> ? 1 : BS * D];
        alignas(64) float vbuf[std::is_same_v<KV, float> ? 1 : BS * D];
        const float *ktf, *vtf;
        if constexpr (std::is_same_v<KV, float>) {
          ktf = kt, vtf = vt;
        } else {
          for (int i = 0; i < BS * D; i += kLanes) {
            store16(kbuf + i, load16(kt + i));
            store16(vbuf + i, load16(vt + i));
          }
          ktf = kbuf, vtf = vbuf;
        }
        for (int h = kvh * group; h < (kvh + 1) * group; h += kMaxHeads) {
          const bool first_heads = h == kvh * group;
          attend_heads_n<BS, D, KV>(std::min(kMaxHeads, (kvh + 1) * group - h), q + h * d, ktf, vtf, i0, i1, acc + h * d,
                                    m + h, l + h, s + h * kMaxBlock, first_heads ? pk : nullptr,
                                    first_heads ? pv : nullptr, softcap);
        }
        continue;
      }
      if (ahead >= 0) {  // other shapes: the later tile in one burst
        for (int64_t c = 0; c * kLineBytes < tile * static_cast<int64_t>(sizeof(KV)); ++c) {
          prefetch_line(k_cache + ahead + kvh * tile, c);
          prefetch_line(v_cache + ahead + kvh * tile, c);
        }
      }
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        float* sh = s + h * kMaxBlock;
        const float* qh = q + h * d;
#pragma omp simd
        for (int i = 0; i < bs; ++i) sh[i] = 0.f;
        for (int e = 0; e < d; ++e) {
          const float qe = qh[e];
          const KV* krow = kt + e * bs;
#pragma omp simd
          for (int i = 0; i < bs; ++i) sh[i] += qe * kv_value(krow[i]);
        }
        if (softcap > 0.f) {
          for (int i = 0; i < bs; ++i) sh[i] = softcap * std::tanh(sh[i] / softcap);
        }
        float block_max = kNegBig;
        for (int i = i0; i < i1; ++i) block_max = std::max(block_max, sh[i]);
        const float new_m = std::max(m[h], block_max);
        const float correction = std::exp(m[h] - new_m);  // exp(-inf) = 0 on the first block
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < bs; ++i) {
          const float p = (i >= i0 && i < i1) ? std::exp(sh[i] - new_m) : 0.f;
          sh[i] = p;
          sum += p;
        }
        l[h] = l[h] * correction + sum;
        m[h] = new_m;
        float* a = acc + h * d;
        if (correction != 1.f) {
#pragma omp simd
          for (int e = 0; e < d; ++e) a[e] *= correction;
        }
        for (int i = i0; i < i1; ++i) {
          const float w = sh[i];
          const KV* v = vt + i * d;
#pragma omp simd
          for (int e = 0; e < d; ++e) a[e] += w * kv_value(v[e]);
        }
      }
    }
  }
}

// out [Hq, D] from parts of one token's keys, each (acc [Hq, D], m [Hq], l [Hq]) as attend_part
// leaves them, `stride` floats apart: each part rescaled to the largest max, summed, divided by
// the summed exponentials, times v_scale. With one part, that division alone.
inline void merge_parts(const float* parts, int num_parts, int64_t stride, int num_heads, int d,
                        float* __restrict out, float v_scale) {
  const int64_t m_at = static_cast<int64_t>(num_heads) * d, l_at = m_at + num_heads;
  for (int h = 0; h < num_heads; ++h) {
    float top = kNegBig;
    for (int p = 0; p < num_parts; ++p) top = std::max(top, parts[p * stride + m_at + h]);
    float sum = 0.f;
    for (int p = 0; p < num_parts; ++p) sum += parts[p * stride + l_at + h] * std::exp(parts[p * stride + m_at + h] - top);
    const float inv = sum > 0.f ? v_scale / sum : 0.f;  // an empty context gives zeros, not NaN
    float* o = out + h * d;
    for (int p = 0; p < num_parts; ++p) {
      const float w = std::exp(parts[p * stride + m_at + h] - top) * inv;
      const float* a = parts + p * stride + h * d;
      if (p == 0) {
#pragma omp simd
        for (int e = 0; e < d; ++e) o[e] = a[e] * w;
      } else {
#pragma omp simd
        for (int e = 0; e < d; ++e) o[e] += a[e] * w;
      }
    }
  }
}

}  // namespace
