// A probe, not a product path: would AMX's tiles take the one-row u4 products off the vector
// units? quant_linear.cpp's int8x3 path, arithmetic-bound at one row on an AMX Xeon
// (docs/benchmarks/cpu-isa.md), issues six vpdpbusd per 128 weights against x's three planes. A
// tile multiply takes the three planes as three rows of A at the cost of one, so this times, on
// random SmolLM2-shaped weights, that path (called through the built library) against a tile
// version of the same integers:
//
//   codes   packed once into tile order, [N / 16][K / 64][8][16][4] bytes (the u4 bytes of 16
//           output rows interleaved 4 at a time: B's VNNI layout), scales and mins [N / 16][G][16];
//   items   two strips of 16 outputs x 128 inputs: each strip's low and high nibbles stored as
//           two 16 x 64 B tiles; A = x's planes for those nibbles, 12 rows (3 planes x 4 chunks
//           of 32, each row zero outside its chunk), shared by the strips; C (12 x 16 int32) =
//           A_lo B_lo + A_hi B_hi (tdpbsud); C stored and read back as vectors, its planes joined
//           (<< 7) and scaled per chunk as int8x3's.
//
// The three stages (nibbles to tile bytes, tile products, products to floats) run as a pipeline
// two items deep, since a tile load waits for the stores before it to retire, and a vector load
// for the tile store. Stage masks time the parts on their own and in pairs; "fixed" runs none
// (x's quantization, the thread team, the tile configuration).
//
//   g++ -O3 -march=native -mamx-tile -mamx-int8 -fopenmp ops/bench/amx_probe.cpp -o /tmp/amx_probe -ldl
//   /tmp/amx_probe "$(python -c 'from conveyor.gpu.backends.cpu.kernels.build import load_library as l; print(l("quant_linear")._name)')" [ROUNDS]
//
// Prints the outputs' largest difference between the two, then ms per 30 layers (one layer's
// four products repeated, so hot in L2), medians of ROUNDS interleaved rounds, at 1 and 2 threads.
#include <dlfcn.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // Linux: ask for the tile state
constexpr int kPlanes = 3, kRows = 4 * kPlanes;                    // A's rows: planes x 4 chunks
enum Stage { kNibbles = 1, kProducts = 2, kFloats = 4 };

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// quant_linear.cpp's WeightArgs and its entry point.
struct WeightArgs {
  const uint8_t* q;
  const void* scales;
  const void* mins;
  int64_t K, N, G, kind, half_scales;
};
using QuantLinear = void (*)(const float*, float*, int64_t, int64_t, const float*, const WeightArgs*);
constexpr int64_t kInt8x3 = 4;  // its path code

// A u4 weight in groups of 32, in both layouts.
struct Layer {
  int64_t N, K;
  std::vector<uint8_t> q, tiled;             // [N, K / 2]; tile order, 512 spare bytes
  std::vector<uint16_t> s, m, tiled_s, tiled_m;  // float16 [N, K / 32]; [N / 16][K / 32][16]
  WeightArgs args;

  Layer(int64_t n, int64_t k) : N(n), K(k), q(n * k / 2), tiled(q.size() + 512), s(n * k / 32), m(s.size()), tiled_s(s.size()), tiled_m(s.size()) {
    for (auto& b : q) b = static_cast<uint8_t>(rand());
    for (auto& v : s) v = _cvtss_sh(0.01f + 0.0001f * (rand() % 100), 0);
    for (auto& v : m) v = _cvtss_sh(-0.08f + 0.0001f * (rand() % 100), 0);
    const int64_t blocks = K / 64, groups = K / 32;
    for (int64_t n0 = 0; n0 < N; n0 += 16)
      for (int64_t b = 0; b < blocks; ++b)
        for (int j = 0; j < 8; ++j)
          for (int c = 0; c < 16; ++c)
            std::memcpy(&tiled[(((n0 / 16 * blocks + b) * 8 + j) * 16 + c) * 4], &q[(n0 + c) * K / 2 + b * 32 + 4 * j], 4);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < groups; ++g) {
        tiled_s[(n / 16 * groups + g) * 16 + n % 16] = s[n * groups + g];
        tiled_m[(n / 16 * groups + g) * 16 + n % 16] = m[n * groups + g];
      }
    args = {q.data(), s.data(), m.data(), K, N, 32, 0, 1};
  }
};

// x [K] -> A's rows per 128 inputs (an item), [items][lo, hi][12][64] bytes: row 3 h + p holds
// plane p of chunk h's inputs in bytes 16 h.. (its first 16 inputs in lo's row, the next 16 in
// hi's), zero elsewhere; dx [K / 32], the last plane's step; xsum [K / 32], x as quantized summed
// per chunk (the mins' part). The same planes as int8x3's (quant_int8.h), by the same rounding.
void quantize_x(const float* x, int64_t K, int8_t* a, float* dx, float* xsum) {
  std::memset(a, 0, (K + 127) / 128 * 2 * kRows * 64);
  for (int64_t c = 0; c < K / 32; ++c) {
    __m512 rest[2] = {_mm512_loadu_ps(x + 32 * c), _mm512_loadu_ps(x + 32 * c + 16)};
    const float amax = std::max(_mm512_reduce_max_ps(_mm512_abs_ps(rest[0])), _mm512_reduce_max_ps(_mm512_abs_ps(rest[1])));
    float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t* item = a + c / 4 * 2 * kRows * 64;
    const int h = static_cast<int>(c % 4);
    xsum[c] = 0.f;
    for (int p = 0; p < kPlanes; ++p, d *= 1.f / 128.f, inv *= 128.f) {
      for (int half = 0; half < 2; ++half) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(rest[half], _mm512_set1_ps(inv)));
        rest[half] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(d), rest[half]);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(item + (half * kRows + 3 * h + p) * 64 + 16 * h), _mm512_cvtsepi32_epi8(v));
        xsum[c] += d * static_cast<float>(_mm512_reduce_add_epi32(v));
      }
    }
    dx[c] = d * 128.f;
  }
}

// y [N] = W x for one row x, the stages in `stages` run. An item is a pair of strips (16 outputs
// each) x 128 inputs: two B tiles a strip (16 x 64 bytes: its low and high nibbles), A's two
// tiles shared. K's last item may be half: its B rows 8.. are the next strip's bytes (the packed
// codes end in 512 spare bytes), met by A's zeros.
void amx_linear(const float* x, float* y, const Layer& w, int stages) {
  const int64_t K = w.K, halves = K / 64, per_strip = (halves + 1) / 2, groups = K / 32, pairs = w.N / 32;
  static std::vector<int8_t> a_rows;
  static std::vector<float> dx, xsum;
  a_rows.resize(per_strip * 2 * kRows * 64), dx.resize(groups), xsum.resize(groups);
  quantize_x(x, K, a_rows.data(), dx.data(), xsum.data());
#pragma omp parallel
  {
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;          // B: strip 0 lo, hi; strip 1 lo, hi
    for (int t = 4; t < 8; ++t) cfg.rows[t] = kRows, cfg.colsb[t] = 64;       // A lo, hi; C strip 0, 1
    _tile_loadconfig(&cfg);
    alignas(64) uint8_t bytes[3][4][1024];
    alignas(64) int32_t c_out[2][2][kRows * 16];
    const __m512i low4 = _mm512_set1_epi8(15);
    const int threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t p0 = pairs * t / threads, items = (pairs * (t + 1) / threads - p0) * per_strip;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t i = 0; i < items + 2; ++i) {
      if (i < items && (stages & kNibbles)) {  // item i: nibbles to bytes
        const int64_t pair = p0 + i / per_strip, at = i % per_strip * 1024;
        for (int s = 0; s < 2; ++s) {
          const uint8_t* p = w.tiled.data() + (2 * pair + s) * halves * 512 + at;
          _mm_prefetch(reinterpret_cast<const char*>(p + 8192), _MM_HINT_T0);
          for (int j = 0; j < 16; ++j) {
            const __m512i r = _mm512_loadu_si512(p + 64 * j);
            _mm512_store_si512(bytes[i % 3][2 * s] + 64 * j, _mm512_and_si512(r, low4));
            _mm512_store_si512(bytes[i % 3][2 * s + 1] + 64 * j, _mm512_and_si512(_mm512_srli_epi16(r, 4), low4));
          }
        }
      }
      if (i >= 2 && (stages & kFloats)) {  // item i - 2: products to floats
        const int64_t k = i - 2, pair = p0 + k / per_strip, b = k % per_strip;
        const int chunks = static_cast<int>(std::min<int64_t>(4, groups - 4 * b));
        for (int s = 0; s < 2; ++s) {
          const int32_t* c = c_out[k % 2][s];
          const uint16_t* scales = &w.tiled_s[(2 * pair + s) * groups * 16];
          for (int h = 0; h < chunks; ++h) {
            const __m512i v = _mm512_add_epi32(
                _mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c + 48 * h), 7), _mm512_load_si512(c + 48 * h + 16)), 7),
                _mm512_load_si512(c + 48 * h + 32));
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (4 * b + h) * 16)));
            acc[s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(_mm512_set1_ps(dx[4 * b + h]), scale), acc[s]);
          }
          if (b == per_strip - 1) {
            const uint16_t* mins = &w.tiled_m[(2 * pair + s) * groups * 16];
            for (int64_t g = 0; g < groups; ++g)
              acc[s] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mins + g * 16))), _mm512_set1_ps(xsum[g]), acc[s]);
            _mm512_storeu_ps(y + (2 * pair + s) * 16, acc[s]);
            acc[s] = _mm512_setzero_ps();
          }
        }
      }
      if (i >= 1 && i <= items && (stages & kProducts)) {  // item i - 1: tile products
        const int64_t j = i - 1;
        const int8_t* a = a_rows.data() + j % per_strip * 2 * kRows * 64;
        _tile_loadd(4, a, 64);
        _tile_loadd(5, a + kRows * 64, 64);
        _tile_loadd(0, bytes[j % 3][0], 64);
        _tile_loadd(1, bytes[j % 3][1], 64);
        _tile_loadd(2, bytes[j % 3][2], 64);
        _tile_loadd(3, bytes[j % 3][3], 64);
        _tile_zero(6);
        _tile_zero(7);
        _tile_dpbsud(6, 4, 0);
        _tile_dpbsud(7, 4, 2);
        _tile_dpbsud(6, 5, 1);
        _tile_dpbsud(7, 5, 3);
        _tile_stored(6, c_out[j % 2][0], 64);
        _tile_stored(7, c_out[j % 2][1], 64);
      }
    }
    _tile_release();
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return std::fprintf(stderr, "usage: amx_probe QUANT_LINEAR_SO [ROUNDS]\n"), 2;
  void* lib = dlopen(argv[1], RTLD_NOW);
  if (!lib) return std::fprintf(stderr, "amx_probe: %s\n", dlerror()), 1;
  const auto int8x3 = reinterpret_cast<QuantLinear>(dlsym(lib, "conveyor_quant_linear_f32"));
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return std::fprintf(stderr, "amx_probe: no tile state\n"), 1;
  srand(1);
  std::vector<Layer> layer;  // one SmolLM2 layer's four products, stacked as served
  for (auto [n, k] : {std::pair{960, 576}, {576, 576}, {3072, 576}, {576, 1536}}) layer.emplace_back(n, k);
  std::vector<float> x(1536), y1(3072), y2(3072);
  for (auto& v : x) v = static_cast<float>(rand() % 2001 - 1000) / 1000.f;
  double diff = 0.0, top = 0.0;
  for (const Layer& w : layer) {
    int8x3(x.data(), y1.data(), 1, kInt8x3, nullptr, &w.args);
    amx_linear(x.data(), y2.data(), w, kNibbles | kProducts | kFloats);
    for (int64_t n = 0; n < w.N; ++n) diff = std::max<double>(diff, std::fabs(y1[n] - y2[n])), top = std::max<double>(top, std::fabs(y1[n]));
  }
  std::printf("max |amx - int8x3| %.3g, max |y| %.3g\n", diff, top);
  const std::vector<std::pair<std::string, int>> forms = {
      {"int8x3", -1}, {"amx", kNibbles | kProducts | kFloats}, {"amx: nibbles", kNibbles}, {"amx: tiles", kProducts}, {"amx: floats", kFloats},
      {"amx: nibbles+tiles", kNibbles | kProducts}, {"amx: tiles+floats", kProducts | kFloats}, {"amx: fixed", 0}};
  std::vector<std::vector<double>> ms(2 * forms.size());
  for (int r = 0; r < rounds; ++r)
    for (int threads = 1; threads <= 2; ++threads) {
      omp_set_num_threads(threads);
      for (size_t f = 0; f < forms.size(); ++f) {
        const auto start = std::chrono::steady_clock::now();
        for (int rep = 0; rep < 30; ++rep)
          for (const Layer& w : layer)
            forms[f].second < 0 ? int8x3(x.data(), y1.data(), 1, kInt8x3, nullptr, &w.args) : amx_linear(x.data(), y2.data(), w, forms[f].second);
        ms[(threads - 1) * forms.size() + f].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
      }
    }
  for (int threads = 1; threads <= 2; ++threads)
    for (size_t f = 0; f < forms.size(); ++f)
      std::printf("%d thread(s)  %-19s %.2f ms per 30 layers\n", threads, forms[f].first.c_str(), median(ms[(threads - 1) * forms.size() + f]));
}
