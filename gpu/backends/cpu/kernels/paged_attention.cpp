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
// Element: float32, or (--kv-cache-dtype fp8, the _fp8 entry points) one byte, an e4m3fn code,
// widened to float in registers as it is read (vector_math.h: load16 and kv_value on uint8_t), so
// a decode streams a quarter of the bytes. The layer's key scale arrives folded into `scale`
// (q . (code * k_scale) = (q * k_scale) . code) and its value scale multiplies the output (v_scale:
// 1 for float caches). Codes are written by conveyor_write_kv_u8, already quantized by the caller.
//
// Rows: tokens of a step are flattened ("varlen"): q and out are [T, Hq, D]; row r owns tokens
// [query_start[r], query_start[r + 1]) and, after this step, seq_lens[r] tokens of context, so
// its query j sits at position seq_len - q_len + j and sees positions
// [max(0, pos + 1 - window), pos] (window 0: no sliding window). With softcap > 0 (Gemma 2)
// each scaled score s becomes softcap * tanh(s / softcap) before the mask and softmax.
//
// The `group` = Hq / Hkv query heads sharing a kv head read its tile side by side, up to four in
// one pass (attend_heads), so the tile comes from memory once per pass. Work items are decode tokens
// (in a step of few rows, parts of a long context, merged after: kPartTokens) and, in prompt
// chunks, runs of tokens that attend together (attend_token_tile), spread over OpenMP threads
// (the same libgomp torch uses: it is already loaded, and the soname resolves to it); a step too
// small to be worth a second thread runs on one.
//
// Blocks are scattered, so the hardware prefetcher cannot guess the next one: while a tile is
// read, the same tile kPrefetchBlocks blocks on is requested in software, a few lines at a time
// between the FMAs (attend_heads). Decode at 256 rows x 500 context reads 25-28 GB/s on two
// cores; a bare scan of the same blocks, 30.
//
// C ABI for ctypes; no torch headers, so the build takes about a second.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "packed_call.h"
#include "paged_attention_decode.h"
#include "paged_attention_prefill.h"

namespace {

constexpr int64_t kSerialWork = 8192;  // key positions x kv heads below which one thread attends
// A decode token's keys in parts of this many (whole blocks), each a work item, where the step has
// fewer tokens than twice the threads: else one stream's token is one thread's work while the
// others wait. SmolLM2 Q4_1 decode steps, 1536 tokens of context (AMD EPYC, 2 threads, process
// ABAB, medians): one row 6.56 -> 5.61 ms, two rows 13.1 -> 10.3; four rows are not split (their
// tokens fill two threads); at 128 tokens nothing is split and the step is unchanged.
constexpr int64_t kPartTokens = 256;

template <int BS, int D, typename KV>
void run(const float* q, const KV* k_cache, const KV* v_cache, const int32_t* block_tables,
         const int32_t* query_start, const int32_t* seq_lens, float* out, int64_t num_rows,
         int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
         int64_t block_size, int64_t window, float scale, float softcap, float v_scale) {
  const int group = static_cast<int>(num_heads / num_kv_heads);
  const int64_t width = num_heads * head_dim;
  // Work items: a decode token alone; a prompt chunk's tokens a query tile at a time where the
  // shape is specialised (attend_token_tile), else one at a time.
  constexpr bool kTiled = BS > 0 && D > 0 && BS % kLanes == 0 && D % kLanes == 0;
  // Consecutive tokens of a prompt chunk per work item: enough to fill a query tile.
  const int32_t tile_tokens = kTiled ? std::max(1, tile_queries<(D > 0 ? D : 16)>() / group) : 1;
  // A token alone attends keys [lo, hi); part >= 0: its slot in `parts`, merged after the loop.
  struct Item {
    int32_t row, t0, n, part;
    int64_t lo, hi;
  };
  struct Split {
    int32_t t, first, count;  // the token, its parts' slots
  };
  std::vector<Item> items;
  std::vector<Split> splits;
  items.reserve(num_rows);
  int64_t positions = 0;  // keys read by all queries, one head: the step's work
  const bool split = num_rows < 2 * static_cast<int64_t>(omp_get_max_threads());
  const int64_t part_tokens = (kPartTokens + block_size - 1) / block_size * block_size;
  int32_t num_parts = 0;
  const auto window_start = [window](int64_t hi) { return window > 0 ? std::max<int64_t>(0, hi - window) : int64_t{0}; };
  for (int64_t r = 0; r < num_rows; ++r) {
    const int32_t begin = query_start[r], end = query_start[r + 1];
    positions += static_cast<int64_t>(end - begin) * seq_lens[r];
    if (end - begin == 1) {
      const int64_t hi = seq_lens[r], lo = window_start(hi);
      const int64_t first = lo - lo % block_size;  // parts start on blocks
      const int32_t count = split ? static_cast<int32_t>((hi - first + part_tokens - 1) / part_tokens) : 1;
      if (count < 2) {
        items.push_back({static_cast<int32_t>(r), begin, 1, -1, lo, hi});
        continue;
      }
      splits.push_back({begin, num_parts, count});
      for (int32_t p = 0; p < count; ++p)
        items.push_back({static_cast<int32_t>(r), begin, 1, num_parts + p, std::max(lo, first + p * part_tokens),
                         std::min(hi, first + (p + 1) * part_tokens)});
      num_parts += count;
      continue;
    }
    const int32_t step = kTiled ? tile_tokens : 1;
    for (int32_t t = begin; t < end; t += step) {
      const int64_t hi = seq_lens[r] - (end - t) + 1;
      items.push_back({static_cast<int32_t>(r), t, std::min(step, end - t), -1, window_start(hi), hi});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t part_stride = width + 2 * num_heads;  // acc [Hq, D], m [Hq], l [Hq]
  std::vector<float> parts(static_cast<size_t>(num_parts) * part_stride);

  // A step of a few short rows (one client decoding) is done in microseconds: waking the other
  // threads would cost more than it saves.
#pragma omp parallel if (positions * num_kv_heads > kSerialWork || num_parts > 0)
  {
    std::vector<float> own(part_stride), qs(width), s(num_heads * kMaxBlock);
    std::vector<float> qbuf, pbuf;
    std::vector<QueryState> states;
#pragma omp for schedule(dynamic, 2)
    for (int64_t it = 0; it < num_items; ++it) {
      const Item item = items[it];
      const int64_t r = item.row, t = item.t0;
      const int64_t q_len = query_start[r + 1] - query_start[r];
      if constexpr (kTiled) {
        if (q_len > 1) {
          const int64_t pos = seq_lens[r] - q_len + (t - query_start[r]);
          attend_token_tile<BS, D, KV>(q, t, item.n, pos, window, scale, k_cache, v_cache,
                                       block_tables + r * max_blocks, static_cast<int>(num_kv_heads),
                                       group, out, qbuf, states, pbuf, softcap, v_scale);
          continue;
        }
      }
      const float* qt = q + t * width;
      for (int64_t i = 0; i < width; ++i) qs[i] = qt[i] * scale;
      float* part = item.part >= 0 ? parts.data() + item.part * part_stride : own.data();
      attend_part<BS, D, KV>(qs.data(), k_cache, v_cache, block_tables + r * max_blocks, item.lo, item.hi,
                             static_cast<int>(block_size), static_cast<int>(head_dim),
                             static_cast<int>(num_kv_heads), group, part, s.data(), part + width,
                             part + width + num_heads, softcap);
      if (item.part < 0) merge_parts(part, 1, part_stride, static_cast<int>(num_heads), static_cast<int>(head_dim), out + t * width, v_scale);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < static_cast<int64_t>(splits.size()); ++i) {
      const Split& sp = splits[i];
      merge_parts(parts.data() + sp.first * part_stride, sp.count, part_stride, static_cast<int>(num_heads),
                  static_cast<int>(head_dim), out + static_cast<int64_t>(sp.t) * width, v_scale);
    }
  }
}

// The shapes specialised at compile time, else the runtime loops. Returns 0, or -1 when the
// shape is outside what this kernel handles (the caller raises).
template <typename KV>
int dispatch(const float* q, const KV* k_cache, const KV* v_cache, const int32_t* block_tables,
             const int32_t* query_start, const int32_t* seq_lens, float* out, int64_t num_rows,
             int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
             int64_t block_size, int64_t window, float scale, float softcap, float v_scale) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads ||
      block_size <= 0 || block_size > kMaxBlock)
    return -1;
#define CONVEYOR_RUN(BS, DIM)                                                                    \
  run<BS, DIM, KV>(q, k_cache, v_cache, block_tables, query_start, seq_lens, out, num_rows,     \
                   max_blocks, num_heads, num_kv_heads, head_dim, block_size, window, scale,     \
                   softcap, v_scale)
  if (block_size == 16 && head_dim == 32) CONVEYOR_RUN(16, 32);
  else if (block_size == 16 && head_dim == 64) CONVEYOR_RUN(16, 64);
  else if (block_size == 16 && head_dim == 128) CONVEYOR_RUN(16, 128);
  else CONVEYOR_RUN(0, 0);
#undef CONVEYOR_RUN
  return 0;
}

// k, v [T, Hkv, D] -> the caches at slot_mapping [T] (block * block_size + offset), in this
// kernel's block order. Slots are distinct, so tokens are independent.
template <typename KV>
void write_kv(const KV* k, const KV* v, KV* k_cache, KV* v_cache, const int64_t* slot_mapping,
              int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
  const int64_t tile = block_size * head_dim;
#pragma omp parallel for if (num_tokens > 256)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slot_mapping[t] / block_size, off = slot_mapping[t] % block_size;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const KV* kt = k + (t * num_kv_heads + h) * head_dim;
      const KV* vt = v + (t * num_kv_heads + h) * head_dim;
      KV* kdst = k_cache + (block * num_kv_heads + h) * tile + off;  // column `off` of [D, bs]
      KV* vdst = v_cache + (block * num_kv_heads + h) * tile + off * head_dim;
      for (int64_t e = 0; e < head_dim; ++e) kdst[e * block_size] = kt[e];
      std::memcpy(vdst, vt, head_dim * sizeof(KV));
    }
  }
}

}  // namespace

extern "C" {

// Attention for a step whose k/v are already written (softcap 0: no soft-capping), over a
// float32 cache, or one of e4m3 codes (outputs times v_scale). 0, or -1 for a shape it cannot take.
int conveyor_paged_attention_f32(const float* q, const float* k_cache, const float* v_cache,
                                 const int32_t* block_tables, const int32_t* query_start,
                                 const int32_t* seq_lens, float* out, int64_t num_rows,
                                 int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, int64_t window,
                                 float scale, float softcap) {
  return dispatch<float>(q, k_cache, v_cache, block_tables, query_start, seq_lens, out, num_rows,
                         max_blocks, num_heads, num_kv_heads, head_dim, block_size, window, scale,
                         softcap, 1.f);
}

int conveyor_paged_attention_fp8(const float* q, const uint8_t* k_cache, const uint8_t* v_cache,
                                 const int32_t* block_tables, const int32_t* query_start,
                                 const int32_t* seq_lens, float* out, int64_t num_rows,
                                 int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, int64_t window,
                                 float scale, float softcap, float v_scale) {
  return dispatch<uint8_t>(q, k_cache, v_cache, block_tables, query_start, seq_lens, out,
                           num_rows, max_blocks, num_heads, num_kv_heads, head_dim, block_size,
                           window, scale, softcap, v_scale);
}

// Write a step's new keys and values, k and v [T, Hkv, D] (float32, or e4m3 codes), in this
// kernel's block order.
void conveyor_write_kv_f32(const float* k, const float* v, float* k_cache, float* v_cache,
                           const int64_t* slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size) {
  write_kv<float>(k, v, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim, block_size);
}

void conveyor_write_kv_u8(const uint8_t* k, const uint8_t* v, uint8_t* k_cache, uint8_t* v_cache,
                          const int64_t* slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                          int64_t head_dim, int64_t block_size) {
  write_kv<uint8_t>(k, v, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim, block_size);
}

}  // extern "C"

// Their packed forms, for recorded programs (packed_call.h).
CONVEYOR_PACKED(conveyor_paged_attention_f32)
CONVEYOR_PACKED(conveyor_paged_attention_fp8)
CONVEYOR_PACKED(conveyor_write_kv_f32)
CONVEYOR_PACKED(conveyor_write_kv_u8)
