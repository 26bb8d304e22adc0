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

// One query head against one (block, kv head) tile, when BS and D are compile-time multiples of
// 16: the scores of the block's keys, the online-softmax update of (m, l), and the value update
// of the head's accumulator `a` [D]. p [BS] is scratch.
//
// Two things made the plain loops (kept below for other shapes) run at half the memory
// bandwidth a bare scan of the same blocks reaches:
//  - Prefetching a whole block ahead in one burst of 256 lines filled the core's miss buffers,
//    so the burst stalled the arithmetic and the arithmetic then left memory idle. Here the
//    caller names the same tile of a later block (pk, pv; null: nothing to fetch): its K lines
//    are requested a few at a time between the score FMAs and its V lines (half the tile)
//    before the value update, so loads and arithmetic overlap.
//  - The dot products were one chain of D dependent FMAs into one score vector; they run in
//    four independent partial sums here, the value update in two.
// KV types the later tile (the cache's element: it sets how many lines to prefetch); the tile
// itself is floats (an fp8 one widened by the caller).
template <int BS, int D, typename KV>
inline void attend_tile(const float* __restrict qh, const float* __restrict kt,
                        const float* __restrict vt, int i0, int i1, float* __restrict a,
                        float* __restrict m, float* __restrict l, float* __restrict p,
                        const KV* pk, const KV* pv, float softcap) {
  constexpr int NB = BS / kLanes, ND = D / kLanes;
  constexpr int kLines = BS * D * static_cast<int>(sizeof(KV)) / kLineBytes;  // lines in a K (or V) tile
  v16 s[NB][4];
  for (int nb = 0; nb < NB; ++nb)
    for (int u = 0; u < 4; ++u) s[nb][u] = v16{};
  for (int e = 0; e < D; e += 4) {
    if (pk) {  // kLines / D * 4 lines of the later K tile per step of 4 dimensions
      for (int c = e * kLines / D; c < (e + 4) * kLines / D; ++c) prefetch_line(pk, c);
    }
    for (int u = 0; u < 4; ++u) {
      const float qe = qh[e + u];
      for (int nb = 0; nb < NB; ++nb) s[nb][u] += qe * load16(kt + (e + u) * BS + nb * kLanes);
    }
  }
  const bool full = i0 == 0 && i1 == BS;
  float block_max = kNegBig;
  for (int nb = 0; nb < NB; ++nb) {
    v16 sv = (s[nb][0] + s[nb][1]) + (s[nb][2] + s[nb][3]);
    store16(p + nb * kLanes, softcap > 0.f ? softcap16(sv, softcap) : sv);
  }
  if (!full) {
    for (int i = 0; i < BS; ++i)
      if (i < i0 || i >= i1) p[i] = kNegBig;
  }
#pragma omp simd reduction(max : block_max)
  for (int i = 0; i < BS; ++i) block_max = std::max(block_max, p[i]);
  const float new_m = std::max(*m, block_max);
  const float correction = std::exp(*m - new_m);
  *l = *l * correction + exp_and_sum(p, BS, new_m);
  *m = new_m;
  // Independent chains for the value update: two per lane group when there are few groups (D /
  // kLanes < 4), one otherwise (eight ymm chains are already enough, and sixteen would spill).
  constexpr int NS = ND >= 4 ? 1 : 2;
  v16 acc[ND][NS];
  for (int dv = 0; dv < ND; ++dv) {
    acc[dv][0] = load16(a + dv * kLanes) * correction;
    if constexpr (NS == 2) acc[dv][NS - 1] = v16{};
  }
  if (pv) {
    for (int c = 0; c < kLines; ++c) prefetch_line(pv, c);
  }
  if (full) {
    for (int i = 0; i < BS; ++i)
      for (int dv = 0; dv < ND; ++dv) acc[dv][i % NS] += p[i] * load16(vt + i * D + dv * kLanes);
  } else {
    for (int i = i0; i < i1; ++i)
      for (int dv = 0; dv < ND; ++dv) acc[dv][i % NS] += p[i] * load16(vt + i * D + dv * kLanes);
  }
  for (int dv = 0; dv < ND; ++dv) store16(a + dv * kLanes, NS == 2 ? acc[dv][0] + acc[dv][NS - 1] : acc[dv][0]);
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
        for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
          const bool first_head = h == kvh * group;
          attend_tile<BS, D, KV>(q + h * d, ktf, vtf, i0, i1, acc + h * d, m + h, l + h, s + h * kMaxBlock,
                                 first_head ? pk : nullptr, first_head ? pv : nullptr, softcap);
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
