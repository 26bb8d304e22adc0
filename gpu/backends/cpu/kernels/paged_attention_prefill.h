// Paged attention's prompt-chunk path: up to kTileQueries query vectors attending together, in
// two passes (paged_attention.cpp says the cache layout and the rows).

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vector_math.h"

namespace {

// Prompt chunks: query vectors attending together, in two passes.
//
// One token at a time, a prompt chunk reads each K and V tile once per query, broadcasts one
// query element per FMA, and pays the online softmax's bookkeeping (horizontal max and sum, a
// scalar exp, rescaling the accumulator) for every 16 keys: prefill of 10 x 200 tokens ran at
// about 40 GFLOPS on two cores, a fifth of what they reach in a GEMM. Here up to kTileQueries
// query vectors (consecutive tokens of one row, times the query heads sharing a kv head) go
// through the context together:
//  1. scores of every key, each K vector loaded once for all of them, into a scratch row per
//     query (masked keys: kNegBig), with a per-lane running max;
//  2. one max, exp and sum per query over its row;
//  3. the weighted sum of values, each V vector loaded once, into accumulators that stay in
//     registers for the whole context.
// The scratch is kTileQueries x context floats (8 x 200 tokens: 6 KB). Decode tokens keep the
// one-pass streaming path above: a single query has nothing to share.
// Query vectors (token, head) sharing one pass over the tiles: as many as keep their score and
// accumulator vectors in registers (NQ * (U + D / 16) of AVX-512's 32, U the score's partial
// sums: 24 at every D). On AVX2 (8 lanes, 16 registers) the same counts measured best too
// (D = 64: 4 beat 2 and 3, SmolLM2's prompt chunks).
template <int D>
constexpr int tile_queries() {
  return D <= 32 ? 8 : D <= 64 ? 4 : 2;
}

struct QueryState {
  const float* q;  // [D], pre-scaled
  float* out;      // [D]
  int64_t lo, hi;  // visible key positions [lo, hi)
};

// NQ query vectors of kv head kvh over key positions [lo, hi), the union of their contexts;
// outputs times v_scale. p: scratch, at least NQ * (hi - lo + 2 * BS) floats. KV: the cache's
// element (float, or uint8_t fp8 codes).
template <int BS, int D, int NQ, typename KV>
void attend_queries(const QueryState* qs, const KV* __restrict k_cache,
                    const KV* __restrict v_cache, const int32_t* __restrict table,
                    int64_t block_stride, int64_t kv_offset, int64_t lo, int64_t hi,
                    float* __restrict p, float softcap, float v_scale) {
  constexpr int NB = BS / kLanes, ND = D / kLanes;
  const int64_t first0 = lo - lo % BS;
  const int64_t span = (hi - first0 + BS - 1) / BS * BS;  // scratch row length, whole blocks
  v16 mx[NQ];
  for (int j = 0; j < NQ; ++j) mx[j] = v16{} + kNegBig;

  // 1. Scores: each K vector loaded once into a register for the NQ queries (folded into each
  // FMA, it was loaded NQ times), in U partial sums a score vector so that at least eight FMA
  // chains run at once (two FMA ports times the FMA's latency; NQ x NB alone was four at D = 64).
  constexpr int U = NQ * NB >= 8 ? 1 : NQ * NB >= 4 ? 2 : NQ * NB >= 2 ? 4 : 8;
  static_assert(D % U == 0, "the score loop steps U dimensions");
  for (int64_t first = first0; first < hi; first += BS) {
    const KV* kt = k_cache + table[first / BS] * block_stride + kv_offset;  // [D, BS]
    v16 s[NQ][NB][U];
    for (int j = 0; j < NQ; ++j)
      for (int nb = 0; nb < NB; ++nb)
        for (int u = 0; u < U; ++u) s[j][nb][u] = v16{};
    for (int e = 0; e < D; e += U) {
      for (int u = 0; u < U; ++u)
        for (int nb = 0; nb < NB; ++nb) {
          const v16 k = in_register(load16(kt + (e + u) * BS + nb * kLanes));
          for (int j = 0; j < NQ; ++j) s[j][nb][u] += qs[j].q[e + u] * k;
        }
    }
    for (int j = 0; j < NQ; ++j) {
      float* pj = p + j * span + (first - first0);
      for (int nb = 0; nb < NB; ++nb) {
        v16 sv = s[j][nb][0];
        for (int u = 1; u < U; ++u) sv += s[j][nb][u];
        store16(pj + nb * kLanes, softcap > 0.f ? softcap16(sv, softcap) : sv);
      }
      if (qs[j].lo > first || qs[j].hi < first + BS) {  // partly outside: mask by lane
        for (int i = 0; i < BS; ++i)
          if (first + i < qs[j].lo || first + i >= qs[j].hi) pj[i] = kNegBig;
      }
      for (int nb = 0; nb < NB; ++nb) {
        const v16 x = load16(pj + nb * kLanes);
        mx[j] = mx[j] > x ? mx[j] : x;
      }
    }
  }

  // 2. Softmax weights, unnormalised: exp(score - max), and their sum.
  float inv_sum[NQ];
  for (int j = 0; j < NQ; ++j) {
    const float m = max_lanes(mx[j]);
    const float sum = exp_and_sum(p + j * span, span, m);
    inv_sum[j] = sum > 0.f ? v_scale / sum : 0.f;
  }

  // 3. Values.
  v16 acc[NQ][ND];
  for (int j = 0; j < NQ; ++j)
    for (int dv = 0; dv < ND; ++dv) acc[j][dv] = v16{};
  for (int64_t first = first0; first < hi; first += BS) {
    const KV* vt = v_cache + table[first / BS] * block_stride + kv_offset;  // [BS, D]
    const float* pb = p + (first - first0);
    for (int i = 0; i < BS; ++i) {
      for (int dv = 0; dv < ND; ++dv) {
        const v16 v = in_register(load16(vt + i * D + dv * kLanes));  // once for the NQ queries
        for (int j = 0; j < NQ; ++j) acc[j][dv] += pb[j * span + i] * v;
      }
    }
  }
  for (int j = 0; j < NQ; ++j)
    for (int dv = 0; dv < ND; ++dv) store16(qs[j].out + dv * kLanes, acc[j][dv] * inv_sum[j]);
}

// Tokens [t0, t0 + n) of row r (consecutive positions pos0 ..), every head: per kv head, the
// (token, head in its group) pairs in chunks of kTileQueries.
template <int BS, int D, typename KV>
void attend_token_tile(const float* q, int64_t t0, int n, int64_t pos0, int64_t window,
                       float scale, const KV* k_cache, const KV* v_cache,
                       const int32_t* table, int num_kv_heads, int group, float* out,
                       std::vector<float>& qbuf, std::vector<QueryState>& states,
                       std::vector<float>& pbuf, float softcap, float v_scale) {
  const int num_heads = num_kv_heads * group;
  const int64_t width = static_cast<int64_t>(num_heads) * D;
  const int64_t tile = static_cast<int64_t>(BS) * D;
  constexpr int kTileQueries = tile_queries<D>();
  const int nq = n * group;
  qbuf.resize(static_cast<size_t>(nq) * D);
  states.resize(nq);
  const int64_t hi_last = pos0 + n;
  const int64_t lo_first = window > 0 ? std::max<int64_t>(0, pos0 + 1 - window) : 0;
  pbuf.resize(static_cast<size_t>(kTileQueries) * (hi_last - lo_first + 2 * BS));
  for (int kvh = 0; kvh < num_kv_heads; ++kvh) {
    for (int j = 0; j < nq; ++j) {
      const int t = j / group, h = kvh * group + j % group;
      const int64_t hi = pos0 + t + 1;
      const float* src = q + (t0 + t) * width + h * D;
      float* qj = qbuf.data() + static_cast<int64_t>(j) * D;
      for (int e = 0; e < D; ++e) qj[e] = src[e] * scale;
      states[j] = {qj, out + (t0 + t) * width + h * D,
                   window > 0 ? std::max<int64_t>(0, hi - window) : 0, hi};
    }
    for (int c = 0; c < nq; c += kTileQueries) {
      const QueryState* chunk = states.data() + c;
      const int m = std::min(kTileQueries, nq - c);
      const int64_t lo = chunk[0].lo, hi = chunk[m - 1].hi;  // positions grow along the chunk
      const int64_t stride = num_kv_heads * tile, offset = kvh * tile;
      float* pb = pbuf.data();
      switch (m) {  // the score and accumulator sets live in registers: NQ is compile-time
#define CONVEYOR_QUERIES(NQ)                                                                     \
  case NQ:                                                                                       \
    if constexpr (NQ <= kTileQueries)                                                            \
      attend_queries<BS, D, NQ, KV>(chunk, k_cache, v_cache, table, stride, offset, lo, hi, pb, \
                                    softcap, v_scale);                                           \
    break;
        CONVEYOR_QUERIES(8) CONVEYOR_QUERIES(7) CONVEYOR_QUERIES(6) CONVEYOR_QUERIES(5)
        CONVEYOR_QUERIES(4) CONVEYOR_QUERIES(3) CONVEYOR_QUERIES(2) CONVEYOR_QUERIES(1)
#undef CONVEYOR_QUERIES
      }
    }
  }
}

}  // namespace
