// Paged attention on the CPU, reading keys and values in place through the block tables.
//
// The torch reference path (gpu/attention.py) gathers every row's blocks into a padded
// contiguous tensor before scaled_dot_product_attention, which copies the whole KV context of
// the step once or twice per layer; on a CPU that copy was three quarters of a decode step.
// Here each (query token, kv head) pair streams its context straight out of the cache once,
// with an online softmax (running max and sum, rescaled per block), so memory traffic is the
// context itself and nothing more.
//
// Layout (gpu/kv_cache.py): one cache per layer [2, num_blocks, block_size, Hkv, D]; the caller
// passes the key half and the value half. Tokens of a step are flattened ("varlen"): q and out
// are [T, Hq, D]; row r owns tokens [query_start[r], query_start[r + 1]) and, after this step,
// seq_lens[r] tokens of context, so its query j sits at position seq_len - q_len + j and sees
// positions [max(0, pos + 1 - window), pos] (window 0: no sliding window).
//
// The `group` = Hq / Hkv query heads sharing a kv head are done together, so each key and value
// is loaded once per group. Work items are (token, kv head) pairs spread over OpenMP threads
// (the same libgomp torch uses: it is already loaded, and the soname resolves to it).
//
// C ABI for ctypes; no torch headers, so the build takes about a second.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kMaxGroup = 16;

template <int D>
inline float dot(const float* __restrict a, const float* __restrict b, int d_rt) {
  const int d = D > 0 ? D : d_rt;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

template <int D>
void attend_one(const float* __restrict q,  // [group, D], pre-scaled
                const float* __restrict k_cache, const float* __restrict v_cache,
                const int32_t* __restrict table, int64_t lo, int64_t hi, int64_t block_size,
                int64_t token_stride,  // Hkv * D: one slot of the cache
                int group, int d_rt, float* __restrict out /* [group, D] of this token */,
                int64_t out_head_stride, float* __restrict scores /* [group, block_size] */,
                float* __restrict acc /* [group, D] */) {
  const int d = D > 0 ? D : d_rt;
  float m[kMaxGroup], l[kMaxGroup];
  for (int g = 0; g < group; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  std::fill(acc, acc + group * d, 0.f);

  for (int64_t p = lo; p < hi;) {
    const int64_t block = table[p / block_size];
    const int64_t off = p % block_size;
    const int n = static_cast<int>(std::min(block_size - off, hi - p));
    const float* kb = k_cache + (block * block_size + off) * token_stride;
    const float* vb = v_cache + (block * block_size + off) * token_stride;
    for (int g = 0; g < group; ++g) {
      float* s = scores + g * block_size;
      float block_max = -INFINITY;
      for (int i = 0; i < n; ++i) {
        s[i] = dot<D>(q + g * d, kb + i * token_stride, d);
        block_max = std::max(block_max, s[i]);
      }
      const float new_m = std::max(m[g], block_max);
      const float correction = std::exp(m[g] - new_m);  // exp(-inf) = 0 on the first block
      float sum = 0.f;
      for (int i = 0; i < n; ++i) {
        s[i] = std::exp(s[i] - new_m);
        sum += s[i];
      }
      l[g] = l[g] * correction + sum;
      m[g] = new_m;
      float* a = acc + g * d;
      if (correction != 1.f) {
#pragma omp simd
        for (int e = 0; e < d; ++e) a[e] *= correction;
      }
      for (int i = 0; i < n; ++i) {
        const float w = s[i];
        const float* v = vb + i * token_stride;
#pragma omp simd
        for (int e = 0; e < d; ++e) a[e] += w * v[e];
      }
    }
    p += n;
  }
  for (int g = 0; g < group; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;  // an empty context gives zeros, not NaN
    float* o = out + g * out_head_stride;
    const float* a = acc + g * d;
#pragma omp simd
    for (int e = 0; e < d; ++e) o[e] = a[e] * inv;
  }
}

template <int D>
void run(const float* q, const float* k_cache, const float* v_cache, const int32_t* block_tables,
         const int32_t* query_start, const int32_t* seq_lens, float* out, int64_t num_rows,
         int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
         int64_t block_size, int64_t window, float scale) {
  const int64_t num_tokens = query_start[num_rows];
  const int group = static_cast<int>(num_heads / num_kv_heads);
  const int d = static_cast<int>(head_dim);
  const int64_t token_stride = num_kv_heads * head_dim;
  std::vector<int32_t> row_of(num_tokens);
  for (int64_t r = 0; r < num_rows; ++r)
    for (int32_t t = query_start[r]; t < query_start[r + 1]; ++t) row_of[t] = static_cast<int32_t>(r);
  const int64_t items = num_tokens * num_kv_heads;

#pragma omp parallel
  {
    std::vector<float> scores(group * block_size), acc(group * d), qs(group * d);
#pragma omp for schedule(dynamic, 8)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t r = row_of[t];
      const int64_t q_len = query_start[r + 1] - query_start[r];
      const int64_t pos = seq_lens[r] - q_len + (t - query_start[r]);
      const int64_t hi = pos + 1;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, hi - window) : 0;
      const float* qt = q + (t * num_heads + h * group) * head_dim;  // [group, D]
      for (int i = 0; i < group * d; ++i) qs[i] = qt[i] * scale;
      attend_one<D>(qs.data(), k_cache + h * head_dim, v_cache + h * head_dim,
                    block_tables + r * max_blocks, lo, hi, block_size, token_stride, group, d,
                    out + (t * num_heads + h * group) * head_dim, head_dim, scores.data(),
                    acc.data());
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, or -1 when the shape is outside what this kernel handles (the caller falls back).
int conveyor_paged_attention_f32(const float* q, const float* k_cache, const float* v_cache,
                                 const int32_t* block_tables, const int32_t* query_start,
                                 const int32_t* seq_lens, float* out, int64_t num_rows,
                                 int64_t max_blocks, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, int64_t window,
                                 float scale) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > kMaxGroup)
    return -1;
#define CONVEYOR_RUN(DIM)                                                                      \
  run<DIM>(q, k_cache, v_cache, block_tables, query_start, seq_lens, out, num_rows, max_blocks, \
           num_heads, num_kv_heads, head_dim, block_size, window, scale)
  switch (head_dim) {
    case 32: CONVEYOR_RUN(32); break;
    case 64: CONVEYOR_RUN(64); break;
    case 128: CONVEYOR_RUN(128); break;
    default: CONVEYOR_RUN(0); break;
  }
#undef CONVEYOR_RUN
  return 0;
}

}  // extern "C"
