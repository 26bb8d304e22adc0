// The two host loops of QuantArgmax (quant_argmax.py, which derives the bound): each row's
// candidates for its argmax from the one-plane logits, and each row's pick among them once they
// are recomputed in three planes. In torch they were a dozen ops over [M, N] (0.8 ms at 9 rows of
// SmolLM2's 49152 logits, a third of what the plane saves); here one pass over y1 a row.
//
// A row of x is valid where all its inputs are finite, which is read from the bits (-ffast-math
// assumes no NaN or inf, so a float test could be folded away); a row that is not valid has no
// candidates, and its logits are never read.
//
// C ABI for ctypes; the OpenMP pool is torch's (see build.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kChunk = 16;  // outputs a chunk: its max is one vector's
constexpr int64_t kBlock = 32;  // inputs per x scale (quant_int8.h's kBlock, quant_argmax.py's BLOCK)

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Row y [N] -> its candidates, ascending, into out [cap]; their number, or -1 past cap.
// Coarse, then exact: every n with y[n] >= top - 2 wide (wide = amax . widest bounds every
// output's bound, so the n maximising y - bound is among them), then of those the n with
// y[n] + bound[n] >= max(y - bound), bound[n] = amax . table[n].
int64_t row_candidates(const float* y, int64_t N, const float* amax, const float* table, const float* widest, int64_t B,
                       int32_t* out, int64_t cap) {
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  std::vector<float> chunk_max(chunks);
  float top = y[0];
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n0 = c * kChunk, n1 = std::min(N, n0 + kChunk);
    float mx = y[n0];
    for (int64_t n = n0 + 1; n < n1; ++n) mx = std::max(mx, y[n]);
    chunk_max[c] = mx;
    top = std::max(top, mx);
  }
  const float threshold = top - 2.f * dot(amax, widest, B);
  std::vector<std::pair<int32_t, float>> coarse;  // (n, y + bound)
  float floor = top;
  bool first = true;
  for (int64_t c = 0; c < chunks; ++c) {
    if (chunk_max[c] < threshold) continue;
    for (int64_t n = c * kChunk; n < std::min(N, (c + 1) * kChunk); ++n) {
      if (y[n] < threshold) continue;
      const float bound = dot(amax, table + n * B, B);
      coarse.emplace_back(static_cast<int32_t>(n), y[n] + bound);
      floor = first ? y[n] - bound : std::max(floor, y[n] - bound);
      first = false;
    }
  }
  int64_t count = 0;
  for (const auto& [n, high] : coarse) {
    if (high < floor) continue;
    if (count == cap) return -1;
    out[count++] = n;
  }
  return count;
}

}  // namespace

extern "C" {

// y1 [M, N] (one plane), x [M, 32 B] (its rows), table [N, B], widest [B] -> valid [M] (x's row
// finite), cols [M, cap] (row m's candidates in its first counts[m]), union_ (their union,
// ascending); returns its size, or -1 where a row has more than cap (the caller takes the full
// product).
int64_t conveyor_argmax_candidates(const float* y1, const float* x, int64_t M, int64_t N, const float* table,
                                   const float* widest, int64_t B, uint8_t* valid, int32_t* cols, int64_t* counts,
                                   int64_t cap, int32_t* union_) {
#pragma omp parallel for schedule(static) if (M > 1)
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * B * kBlock;
    std::vector<float> amax(B);  // each block's largest |x|: the bound's factor
    bool finite = true;
    for (int64_t b = 0; b < B; ++b) {
      float top = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        const float v = xm[b * kBlock + i];
        uint32_t bits;
        std::memcpy(&bits, &v, sizeof bits);
        finite &= (bits & 0x7f800000u) != 0x7f800000u;
        top = std::max(top, std::fabs(v));
      }
      amax[b] = top;
    }
    valid[m] = finite;
    counts[m] = finite ? row_candidates(y1 + m * N, N, amax.data(), table, widest, B, cols + m * cap, cap) : 0;
  }
  std::vector<int32_t> all;
  for (int64_t m = 0; m < M; ++m) {
    if (counts[m] < 0) return -1;
    all.insert(all.end(), cols + m * cap, cols + m * cap + counts[m]);
  }
  std::sort(all.begin(), all.end());
  const int64_t size = std::unique(all.begin(), all.end()) - all.begin();
  std::copy(all.begin(), all.begin() + size, union_);
  return size;
}

// y3 [M, U] (the union's outputs, three planes) -> ids [M]: each valid row's largest among its own
// candidates, the lowest id among equals (as torch's argmax); 0 for the others.
void conveyor_argmax_pick(const float* y3, int64_t M, int64_t U, const int32_t* union_, const int32_t* cols,
                          const int64_t* counts, int64_t cap, const uint8_t* valid, int64_t* ids) {
  for (int64_t m = 0; m < M; ++m) {
    ids[m] = 0;
    if (!valid[m]) continue;
    float best = 0.f;
    for (int64_t j = 0; j < counts[m]; ++j) {  // ascending ids: a later one must be strictly larger
      const int32_t n = cols[m * cap + j];
      const float v = y3[m * U + (std::lower_bound(union_, union_ + U, n) - union_)];
      if (j == 0 || v > best) best = v, ids[m] = n;
    }
  }
}

}  // extern "C"
