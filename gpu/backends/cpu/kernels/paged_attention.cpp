// Paged attention on the CPU, reading keys and values in place through the block tables.
//
// The torch backend (gpu/backends/torch/attention.py) gathers every row's blocks into a padded
// contiguous tensor before scaled_dot_product_attention, which copies the whole KV context of
// the step once or twice per layer; on a CPU that copy was three quarters of a decode step.
// Here each query token streams its context straight out of the cache once, with an online
// softmax (running max and sum, rescaled per block), so memory traffic is the
// context itself and nothing more.
//
// Cache layout. The cache is one [2, num_blocks, Hkv, block_size * D] buffer per layer, as the
// cpu backend (gpu/backends/cpu/attention.py) declares and allocates it: head-major, keys
// transposed, values not:
//   keys   of block b, head h: [D, block_size]   at k_cache + (b * Hkv + h) * D * block_size
//   values of block b, head h: [block_size, D]   at v_cache + (b * Hkv + h) * block_size * D
// so one (block, head) tile is contiguous, and the scores of a whole block are D vertical FMAs
// over block_size lanes (no horizontal sum per key), and the value update is block_size FMAs
// over D lanes. Only the functions here read or write that order; copy-on-write copies whole
// blocks, which is order-blind.
//
// Rows: tokens of a step are flattened ("varlen"): q and out are [T, Hq, D]; row r owns tokens
// [query_start[r], query_start[r + 1]) and, after this step, seq_lens[r] tokens of context, so
// its query j sits at position seq_len - q_len + j and sees positions
// [max(0, pos + 1 - window), pos] (window 0: no sliding window). With softcap > 0 (Gemma 2)
// each scaled score s becomes softcap * tanh(s / softcap) before the mask and softmax.
//
// The `group` = Hq / Hkv query heads sharing a kv head read its tile one after the other, so the
// tile comes from memory once per group and from L1 after that. Work items are decode tokens
// and, in prompt chunks, runs of tokens that attend together (attend_token_tile),
// spread over OpenMP threads (the same libgomp torch uses: it is already loaded, and the soname
// resolves to it); a step too small to be worth a second thread runs on one.
//
// Blocks are scattered, so the hardware prefetcher cannot guess the next one: while a tile is
// read, the same tile kPrefetchBlocks blocks on is requested in software, a few lines at a time
// between the FMAs (attend_tile). Decode at 256 rows x 500 context reads 25-28 GB/s on two
// cores; a bare scan of the same blocks, 30.
//
// C ABI for ctypes; no torch headers, so the build takes about a second.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kMaxBlock = 256;
// The online softmax's starting max and masked lanes' score: finite, because -ffast-math lets
// the compiler assume no infinities (exp of it minus any real score is still exactly 0).
constexpr float kNegBig = -1e30f;
constexpr int kPrefetchBlocks = 2;  // how far ahead in a block table to prefetch
constexpr int64_t kSerialWork = 8192;  // key positions x kv heads below which one thread attends

// One query token, every head: q [Hq, D] pre-scaled -> out [Hq, D]. Query heads h * group ..
// h * group + group - 1 read kv head h. A block's tiles for all heads are adjacent, so the token
// walks its context as one stream of whole blocks. BS and D are compile-time where specialised
// (0: read the runtime value).

// One vector of float lanes, as wide as the target's registers: 16 with AVX-512 (a zmm), else 8
// (a ymm with AVX2, two NEON q registers). GCC and Clang lower the arithmetic to the target, but
// a 64-byte vector on AVX2 was lowered through the stack: every partial sum spilled, and decode
// attention ran at 6 GB/s on a 34 GB/s machine (200 rows x 192 context, SmolLM2's heads).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float v16 __attribute__((vector_size(kLanes * 4)));
constexpr int kLineFloats = 16;  // floats in a 64-byte cache line: the prefetch stride

inline v16 load16(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof r);  // an unaligned vector load
  return r;
}
inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

typedef int32_t vi16 __attribute__((vector_size(kLanes * 4)));

// exp of 16 lanes, inline: 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by
// Cephes' degree-6 polynomial for expf, 2^n written into the exponent bits. Against exp in
// double: within 1.4 ulp for x in [-20, 0] (the weights a softmax keeps), 4.5 ulp down to -87,
// where a weight is under 1e-37 of the largest. Lanes below -87 (masked scores among them) give
// exactly 0. With std::exp GCC called libmvec once per vector, or scalar expf once per lane
// (121 call sites in the D = 32 build): a quarter to two fifths of prompt attention's time.
inline v16 exp16(v16 x) {
  const v16 zero = v16{};
  const v16 lo = zero - 87.f;
  const v16 xc = x < lo ? lo : (x > 88.f ? zero + 88.f : x);
  // n = round(x / ln 2), by truncating x / ln 2 +- 1/2 (a conversion, so -ffast-math cannot
  // fold it away as it would the add-and-subtract rounding trick).
  const v16 y = xc * 1.44269504088896341f;
  const vi16 ni = __builtin_convertvector(y + (y < zero ? zero - 0.5f : zero + 0.5f), vi16);
  const v16 n = __builtin_convertvector(ni, v16);
  const v16 r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // ln 2 in two parts
  v16 p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const vi16 bits = (ni + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < lo ? zero : p * scale;
}

// softcap * tanh(x / softcap) for 16 lanes, as softcap * (1 - 2 / (exp(2x / softcap) + 1)):
// exp16 saturates where tanh is +-1 to float precision, and its error near 0 is about one ulp
// of 1, times softcap.
inline v16 softcap16(v16 x, float softcap) {
  const v16 e = exp16(x * (2.f / softcap));
  return (1.f - 2.f / (e + 1.f)) * softcap;
}

// p[i] = exp(p[i] - m) for i < n, returning their sum: the softmax's unnormalised weights.
// Masked scores (kNegBig) give exactly 0.
inline float exp_and_sum(float* __restrict p, int64_t n, float m) {
  v16 acc = v16{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const v16 e = exp16(load16(p + i) - m);
    store16(p + i, e);
    acc += e;
  }
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  for (; i < n; ++i) {
    p[i] = std::exp(p[i] - m);
    sum += p[i];
  }
  return sum;
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
template <int BS, int D>
inline void attend_tile(const float* __restrict qh, const float* __restrict kt,
                        const float* __restrict vt, int i0, int i1, float* __restrict a,
                        float* __restrict m, float* __restrict l, float* __restrict p,
                        const float* pk, const float* pv, float softcap) {
  constexpr int NB = BS / kLanes, ND = D / kLanes;
  constexpr int kLines = BS * D / kLineFloats;  // 64-byte lines in a K (or V) tile
  v16 s[NB][4];
  for (int nb = 0; nb < NB; ++nb)
    for (int u = 0; u < 4; ++u) s[nb][u] = v16{};
  for (int e = 0; e < D; e += 4) {
    if (pk) {  // kLines / D * 4 lines of the later K tile per step of 4 dimensions
      for (int c = e * kLines / D; c < (e + 4) * kLines / D; ++c)
        __builtin_prefetch(pk + c * kLineFloats, 0, 1);
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
    for (int c = 0; c < kLines; ++c) __builtin_prefetch(pv + c * kLineFloats, 0, 1);
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

template <int BS, int D>
void attend_token(const float* __restrict q, const float* __restrict k_cache,
                  const float* __restrict v_cache, const int32_t* __restrict table, int64_t lo,
                  int64_t hi, int bs_rt, int d_rt, int num_kv_heads, int group,
                  float* __restrict out, float* __restrict acc /* [Hq, D] */,
                  float* __restrict s /* [Hq, kMaxBlock] */, float* __restrict m,
                  float* __restrict l /* [Hq] each */, float softcap) {
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
      const float* kt = k_cache + block * block_stride + kvh * tile;  // [D, bs]
      const float* vt = v_cache + block * block_stride + kvh * tile;  // [bs, D]
      if constexpr (BS > 0 && D > 0 && BS % kLanes == 0 && D % kLanes == 0) {
        const float* pk = ahead >= 0 ? k_cache + ahead + kvh * tile : nullptr;
        const float* pv = ahead >= 0 ? v_cache + ahead + kvh * tile : nullptr;
        for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
          const bool first_head = h == kvh * group;
          attend_tile<BS, D>(q + h * d, kt, vt, i0, i1, acc + h * d, m + h, l + h, s + h * kMaxBlock,
                             first_head ? pk : nullptr, first_head ? pv : nullptr, softcap);
        }
        continue;
      }
      if (ahead >= 0) {  // other shapes: the later tile in one burst
        for (int64_t c = 0; c < tile; c += kLineFloats) {
          __builtin_prefetch(k_cache + ahead + kvh * tile + c, 0, 1);
          __builtin_prefetch(v_cache + ahead + kvh * tile + c, 0, 1);
        }
      }
      for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        float* sh = s + h * kMaxBlock;
        const float* qh = q + h * d;
#pragma omp simd
        for (int i = 0; i < bs; ++i) sh[i] = 0.f;
        for (int e = 0; e < d; ++e) {
          const float qe = qh[e];
          const float* krow = kt + e * bs;
#pragma omp simd
          for (int i = 0; i < bs; ++i) sh[i] += qe * krow[i];
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
          const float* v = vt + i * d;
#pragma omp simd
          for (int e = 0; e < d; ++e) a[e] += w * v[e];
        }
      }
    }
  }
  for (int h = 0; h < num_heads; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;  // an empty context gives zeros, not NaN
    float* o = out + h * d;
    const float* a = acc + h * d;
#pragma omp simd
    for (int e = 0; e < d; ++e) o[e] = a[e] * inv;
  }
}

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
// accumulator vectors in registers (NQ * (1 + D / 16) of AVX-512's 32). On AVX2 (8 lanes, 16
// registers) the same counts measured best too (D = 64: 4 beat 2 and 3, SmolLM2's prompt chunks).
template <int D>
constexpr int tile_queries() {
  return D <= 32 ? 8 : D <= 64 ? 4 : 2;
}

struct QueryState {
  const float* q;  // [D], pre-scaled
  float* out;      // [D]
  int64_t lo, hi;  // visible key positions [lo, hi)
};

// NQ query vectors of kv head kvh over key positions [lo, hi), the union of their contexts.
// p: scratch, at least NQ * (hi - lo + 2 * BS) floats.
template <int BS, int D, int NQ>
void attend_queries(const QueryState* qs, const float* __restrict k_cache,
                    const float* __restrict v_cache, const int32_t* __restrict table,
                    int64_t block_stride, int64_t kv_offset, int64_t lo, int64_t hi,
                    float* __restrict p, float softcap) {
  constexpr int NB = BS / kLanes, ND = D / kLanes;
  const int64_t first0 = lo - lo % BS;
  const int64_t span = (hi - first0 + BS - 1) / BS * BS;  // scratch row length, whole blocks
  v16 mx[NQ];
  for (int j = 0; j < NQ; ++j) mx[j] = v16{} + kNegBig;

  // 1. Scores.
  for (int64_t first = first0; first < hi; first += BS) {
    const float* kt = k_cache + table[first / BS] * block_stride + kv_offset;  // [D, BS]
    v16 s[NQ][NB];
    for (int j = 0; j < NQ; ++j)
      for (int nb = 0; nb < NB; ++nb) s[j][nb] = v16{};
    for (int e = 0; e < D; ++e) {
      for (int nb = 0; nb < NB; ++nb) {
        const v16 k = load16(kt + e * BS + nb * kLanes);
        for (int j = 0; j < NQ; ++j) s[j][nb] += qs[j].q[e] * k;
      }
    }
    for (int j = 0; j < NQ; ++j) {
      float* pj = p + j * span + (first - first0);
      for (int nb = 0; nb < NB; ++nb)
        store16(pj + nb * kLanes, softcap > 0.f ? softcap16(s[j][nb], softcap) : s[j][nb]);
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
    float m = kNegBig;
    for (int i = 0; i < kLanes; ++i) m = std::max(m, mx[j][i]);
    const float sum = exp_and_sum(p + j * span, span, m);
    inv_sum[j] = sum > 0.f ? 1.f / sum : 0.f;
  }

  // 3. Values.
  v16 acc[NQ][ND];
  for (int j = 0; j < NQ; ++j)
    for (int dv = 0; dv < ND; ++dv) acc[j][dv] = v16{};
  for (int64_t first = first0; first < hi; first += BS) {
    const float* vt = v_cache + table[first / BS] * block_stride + kv_offset;  // [BS, D]
    const float* pb = p + (first - first0);
    for (int i = 0; i < BS; ++i) {
      for (int dv = 0; dv < ND; ++dv) {
        const v16 v = load16(vt + i * D + dv * kLanes);
        for (int j = 0; j < NQ; ++j) acc[j][dv] += pb[j * span + i] * v;
      }
    }
  }
  for (int j = 0; j < NQ; ++j)
    for (int dv = 0; dv < ND; ++dv) store16(qs[j].out + dv * kLanes, acc[j][dv] * inv_sum[j]);
}

// Tokens [t0, t0 + n) of row r (consecutive positions pos0 ..), every head: per kv head, the
// (token, head in its group) pairs in chunks of kTileQueries.
template <int BS, int D>
void attend_token_tile(const float* q, int64_t t0, int n, int64_t pos0, int64_t window,
                       float scale, const float* k_cache, const float* v_cache,
                       const int32_t* table, int num_kv_heads, int group, float* out,
                       std::vector<float>& qbuf, std::vector<QueryState>& states,
                       std::vector<float>& pbuf, float softcap) {
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
      attend_queries<BS, D, NQ>(chunk, k_cache, v_cache, table, stride, offset, lo, hi, pb,    \
                                softcap);                                                        \
    break;
        CONVEYOR_QUERIES(8) CONVEYOR_QUERIES(7) CONVEYOR_QUERIES(6) CONVEYOR_QUERIES(5)
        CONVEYOR_QUERIES(4) CONVEYOR_QUERIES(3) CONVEYOR_QUERIES(2) CONVEYOR_QUERIES(1)
#undef CONVEYOR_QUERIES
      }
    }
  }
}

template <int BS, int D>
void run(const float* q, const float* k_cache, const float* v_cache, const int32_t* block_tables,
         const int32_t* query_start, const int32_t* seq_lens, float* out, int64_t num_rows,
         int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
         int64_t block_size, int64_t window, float scale, float softcap) {
  const int group = static_cast<int>(num_heads / num_kv_heads);
  const int64_t width = num_heads * head_dim;
  // Work items: a decode token alone; a prompt chunk's tokens a query tile at a time where the
  // shape is specialised (attend_token_tile), else one at a time.
  constexpr bool kTiled = BS > 0 && D > 0 && BS % kLanes == 0 && D % kLanes == 0;
  // Consecutive tokens of a prompt chunk per work item: enough to fill a query tile.
  const int32_t tile_tokens = kTiled ? std::max(1, tile_queries<(D > 0 ? D : 16)>() / group) : 1;
  struct Item {
    int32_t row, t0, n;
  };
  std::vector<Item> items;
  items.reserve(num_rows);
  int64_t positions = 0;  // keys read by all queries, one head: the step's work
  for (int64_t r = 0; r < num_rows; ++r) {
    const int32_t begin = query_start[r], end = query_start[r + 1];
    positions += static_cast<int64_t>(end - begin) * seq_lens[r];
    const int32_t step = kTiled && end - begin > 1 ? tile_tokens : 1;
    for (int32_t t = begin; t < end; t += step)
      items.push_back({static_cast<int32_t>(r), t, std::min(step, end - t)});
  }
  const int64_t num_items = static_cast<int64_t>(items.size());

  // A step of a few short rows (one client decoding) is done in microseconds: waking the other
  // threads would cost more than it saves.
#pragma omp parallel if (positions * num_kv_heads > kSerialWork)
  {
    std::vector<float> acc(width), qs(width), s(num_heads * kMaxBlock), m(num_heads), l(num_heads);
    std::vector<float> qbuf, pbuf;
    std::vector<QueryState> states;
#pragma omp for schedule(dynamic, 2)
    for (int64_t it = 0; it < num_items; ++it) {
      const Item item = items[it];
      const int64_t r = item.row, t = item.t0;
      const int64_t q_len = query_start[r + 1] - query_start[r];
      const int64_t pos = seq_lens[r] - q_len + (t - query_start[r]);
      if constexpr (kTiled) {
        if (item.n > 1 || q_len > 1) {
          attend_token_tile<BS, D>(q, t, item.n, pos, window, scale, k_cache, v_cache,
                                   block_tables + r * max_blocks, static_cast<int>(num_kv_heads),
                                   group, out, qbuf, states, pbuf, softcap);
          continue;
        }
      }
      const int64_t hi = pos + 1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, hi - window) : 0;
      const float* qt = q + t * width;
      for (int64_t i = 0; i < width; ++i) qs[i] = qt[i] * scale;
      attend_token<BS, D>(qs.data(), k_cache, v_cache, block_tables + r * max_blocks, lo, hi,
                          static_cast<int>(block_size), static_cast<int>(head_dim),
                          static_cast<int>(num_kv_heads), group, out + t * width, acc.data(),
                          s.data(), m.data(), l.data(), softcap);
    }
  }
}

}  // namespace

extern "C" {

// Attention for a step whose k/v are already written (softcap 0: no soft-capping). Returns 0, or -1 when the shape is
// outside what this kernel handles (the caller raises).
int conveyor_paged_attention_f32(const float* q, const float* k_cache, const float* v_cache,
                                 const int32_t* block_tables, const int32_t* query_start,
                                 const int32_t* seq_lens, float* out, int64_t num_rows,
                                 int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, int64_t window,
                                 float scale, float softcap) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads ||
      block_size <= 0 || block_size > kMaxBlock)
    return -1;
#define CONVEYOR_RUN(BS, DIM)                                                                \
  run<BS, DIM>(q, k_cache, v_cache, block_tables, query_start, seq_lens, out, num_rows,     \
               max_blocks, num_heads, num_kv_heads, head_dim, block_size, window, scale, softcap)
  if (block_size == 16 && head_dim == 32) CONVEYOR_RUN(16, 32);
  else if (block_size == 16 && head_dim == 64) CONVEYOR_RUN(16, 64);
  else if (block_size == 16 && head_dim == 128) CONVEYOR_RUN(16, 128);
  else CONVEYOR_RUN(0, 0);
#undef CONVEYOR_RUN
  return 0;
}

// Write a step's new keys and values, k and v [T, Hkv, D], at slot_mapping [T] (block *
// block_size + offset) in this kernel's block order. Slots are distinct, so tokens are
// independent.
void conveyor_write_kv_f32(const float* k, const float* v, float* k_cache, float* v_cache,
                           const int64_t* slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size) {
  const int64_t tile = block_size * head_dim;
#pragma omp parallel for if (num_tokens > 256)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slot_mapping[t] / block_size, off = slot_mapping[t] % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const float* kt = k + (t * num_kv_heads + h) * head_dim;
      const float* vt = v + (t * num_kv_heads + h) * head_dim;
      float* kdst = k_cache + (block * num_kv_heads + h) * tile + off;  // column `off` of [D, bs]
      float* vdst = v_cache + (block * num_kv_heads + h) * tile + off * head_dim;
      for (int64_t e = 0; e < head_dim; ++e) kdst[e * block_size] = kt[e];
      std::memcpy(vdst, vt, head_dim * sizeof(float));
    }
  }
}

}  // extern "C"
