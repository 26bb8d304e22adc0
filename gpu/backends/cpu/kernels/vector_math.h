// The C++ CPU kernels' vector layer: float vectors as wide as the target's registers, unaligned
// loads and stores (of floats, or of fp8 e4m3 codes widened to floats), and the exp and softmax
// pieces that paged attention needs. Included by each kernel's .cpp (one translation unit each);
// build.py hashes the headers with the source.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// The online softmax's starting max and masked lanes' score: finite, because -ffast-math lets
// the compiler assume no infinities (exp of it minus any real score is still exactly 0).
constexpr float kNegBig = -1e30f;

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
constexpr int kLineBytes = 64;  // a cache line: the prefetch stride

inline v16 load16(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof r);  // an unaligned vector load
  return r;
}
inline void store16(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

// x, held in a register where it is used several times: an empty asm claims to change it, so the
// compiler cannot fold its load into each use. GCC 12 tunes -march=native on Zen 5 (which it
// does not know) as znver3, whose costs folded decoded_block's loads into its FMAs: each vector
// of x re-read from memory for every output and a weight vector spilled, 25-35% slower than the
// same source tuned generic (a SmolLM2 layer's four u4 products at 16 rows, 0.555 against 0.394
// ms). Pinned, the two tunings give the same code.
inline v16 in_register(v16 x) {
#if defined(__AVX2__)
  asm("" : "+v"(x));
#endif
  return x;
}

// fp8 KV caches (--kv-cache-dtype fp8) hold e4m3fn codes, one byte a value: sign, 4 exponent bits
// (bias 7), 3 mantissa bits; 448 at most, subnormals below 2^-6 in steps of 2^-9. The kernels read
// them through the overloads below, which return the exact value (a NaN code, never written,
// reads as 480); a layer's scale is applied outside (paged_attention.cpp).
//
// In vectors, a code's bits are moved into a half (sign to bit 15, exponent and mantissa to bits
// 14..7: the number 2^-8 times the code's value, since the biases differ by 8), which the
// hardware widens to float exactly, subnormal halves included, then times 2^8. Moving the bits
// straight into a float (<< 20, times 2^120) is exact too, but makes each e4m3 subnormal (small
// keys and values: common) a float subnormal: on an AVX-512 Xeon that path converted 0.27 G codes/s
// against 9-10 for normal codes (microcode assists), and it reads them as 0 where DAZ is set.
inline float kv_value(float x) { return x; }
// One code, scalar, no float subnormals: normal codes by rebiasing the exponent (127 - 7),
// subnormal ones (exponent 0) as mantissa x 2^-9.
inline float kv_value(uint8_t c) {
  const uint32_t bits = ((c & 0x7fu) << 20) + (120u << 23);
  float normal;
  std::memcpy(&normal, &bits, sizeof normal);
  const float magnitude = (c & 0x78) ? normal : static_cast<float>(c & 7) * 0x1p-9f;
  return (c & 0x80) ? -magnitude : magnitude;
}

#if defined(__AVX512F__)
inline v16 load16(const uint8_t* p) {  // 16 codes
  const __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(c, 7), _mm256_set1_epi16(0x3f80)),
                                    _mm256_and_si256(_mm256_slli_epi16(c, 8), _mm256_set1_epi16(short(0x8000))));
  return (v16)_mm512_cvtph_ps(h) * 256.f;
}
#elif defined(__AVX2__) && defined(__F16C__)
inline v16 load16(const uint8_t* p) {  // 8 codes
  const __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(c, 7), _mm_set1_epi16(0x3f80)),
                                 _mm_and_si128(_mm_slli_epi16(c, 8), _mm_set1_epi16(short(0x8000))));
  return (v16)_mm256_cvtph_ps(h) * 256.f;
}
#else
inline v16 load16(const uint8_t* p) {  // other targets: one code at a time
  v16 r;
  for (int i = 0; i < kLanes; ++i) r[i] = kv_value(p[i]);
  return r;
}
#endif

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

// A vector's lanes folded by op (a generic lambda on GCC vectors: max or +), halves first: lanes i
// and i + n / 2 at each level, a tree of log2(kLanes) steps where a loop over the lanes is a chain
// of kLanes.
template <class Op>
inline float fold_lanes(v16 x, Op op) {
#if defined(__AVX2__) && defined(__F16C__)
#if defined(__AVX512F__)
  const __m512 z = reinterpret_cast<__m512>(x);
  const __m256 h = op(_mm512_castps512_ps256(z), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1)));
#else
  const __m256 h = reinterpret_cast<__m256>(x);
#endif
  __m128 t = op(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  t = op(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(op(t, _mm_movehdup_ps(t)));
#else
  float r = x[0];
  for (int i = 1; i < kLanes; ++i) r = op(r, x[i]);
  return r;
#endif
}
inline float max_lanes(v16 x) {
  return fold_lanes(x, [](auto a, auto b) { return a > b ? a : b; });
}
inline float sum_lanes(v16 x) {
  return fold_lanes(x, [](auto a, auto b) { return a + b; });
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

// A linear's weights (quantized or float32) stream from memory once a step; a thread asks for rows
// kPrefetchBytes ahead of the ones it reads (measured on one core, 1536 x 576 u4: none 100 us, 1
// KB to 8 KB 95 to 99 us; 2-16 KB moved a one-row step of SmolLM2 by 2-5%, not the same sign in
// every build).
constexpr int64_t kPrefetchBytes = 4096;

// The cache lines of s[0, count), asked for now. A quantized row's scales and mins are a few
// dozen bytes in arrays of their own, read after its codes (the mins at a block's end): streams
// that a prefetch of the codes alone does not cover. Asked for as far ahead as the codes, they
// cut a one-row step of SmolLM2 Q4_1 from 4.19 to 3.25 ms (AMD EPYC Zen 5, medians of 10
// interleaved rounds); left to the hardware prefetcher, a quarter of the u4 kernel's samples sat
// on the mins' loads.
template <class T>
inline void prefetch_span(const T* s, int64_t count) {
  const char* p = reinterpret_cast<const char*>(s);
  const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at);
  __builtin_prefetch(p + bytes - 1);  // the last line, where the span is not line-aligned
}

}  // namespace
