// The x86 vector operations quant_int8.h is written in, at the build's width: 512 bits with
// AVX-512 (F, BW), 256 with AVX2. Byte products take VNNI's vpdpbusd where the build has it
// (AVX512-VNNI, or AVX-VNNI at 256 bits), else vpmaddubsw + vpmaddwd, whose 16-bit pair sums
// saturate past 32767: callers keep |unsigned byte * signed byte| * 2 below that.

#pragma once

#if defined(__AVX2__)
#define CONVEYOR_INT8 1

#include <immintrin.h>

#include <cstdint>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kIntLanes = 16;
typedef __m512i ivec;
typedef __m512 fvec;
// The first n lanes of a vector, 1 <= n <= kIntLanes: made once, used by many scale loads.
struct FirstLanes {
  __mmask16 mask;
  explicit FirstLanes(int n) : mask(static_cast<__mmask16>((1u << n) - 1)) {}
};
// The first n scales (float32, or float16 bits) as floats, zeros after.
inline fvec load_scales(const float* p, const FirstLanes& f) { return _mm512_maskz_loadu_ps(f.mask, p); }
inline fvec load_scales(const uint16_t* p, const FirstLanes& f) {
  return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(f.mask, p)));
}
inline ivec load_bytes(const uint8_t* p, int64_t n) {  // n <= 64 bytes, zeros after
  return n >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ull << n) - 1, p);
}
inline fvec load_fvec(const float* p) { return _mm512_loadu_ps(p); }
inline ivec load_ivec(const void* p) { return _mm512_loadu_si512(p); }
inline fvec permute(ivec idx, fvec v) { return _mm512_permutexvar_ps(idx, v); }
inline ivec bytes(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
inline ivec srl4(ivec v) { return _mm512_srli_epi16(v, 4); }
inline ivec sll7(ivec v) { return _mm512_slli_epi32(v, 7); }
inline ivec and_(ivec a, ivec b) { return _mm512_and_si512(a, b); }
inline ivec xor_(ivec a, ivec b) { return _mm512_xor_si512(a, b); }
inline fvec cvt(ivec v) { return _mm512_cvtepi32_ps(v); }
inline ivec round_to_int(fvec v) { return _mm512_cvtps_epi32(v); }  // to nearest, ties to even
inline ivec abs8(ivec c) { return _mm512_abs_epi8(c); }
inline float max_abs(fvec v) { return _mm512_reduce_max_ps(_mm512_abs_ps(v)); }
inline int32_t sum_ints(ivec v) { return _mm512_reduce_add_epi32(v); }
inline void store_int8(int8_t* p, ivec v) {  // kIntLanes int32, saturated to int8
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(v));
}
inline ivec sign_of(ivec x, ivec c) {  // x where c >= 0, -x where c < 0 (AVX-512 has no vpsignb)
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(c), _mm512_setzero_si512(), x);
}
// Without VNNI, the byte products' two halves: 16-bit sums of adjacent pairs (saturating), and
// adjacent 16-bit sums times w widened to int32 and added.
inline ivec pair_sums(ivec u, ivec s) { return _mm512_maddubs_epi16(u, s); }
inline ivec add16(ivec a, ivec b) { return _mm512_add_epi16(a, b); }
inline ivec add32(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline ivec widen(ivec pairs, int16_t w) { return _mm512_madd_epi16(pairs, _mm512_set1_epi16(w)); }
#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
inline ivec dot(ivec acc, ivec u, ivec s) { return _mm512_dpbusd_epi32(acc, u, s); }
#else
constexpr bool kVnni = false;
inline ivec dot(ivec acc, ivec u, ivec s) { return add32(acc, widen(pair_sums(u, s), 1)); }
#endif
// The lane sums of a, b, c, d: 128-bit quarters folded pairwise, then within each quarter.
inline __m128 hsum4(fvec a, fvec b, fvec c, fvec d) {
  const fvec ab = _mm512_shuffle_f32x4(a, b, 0x44) + _mm512_shuffle_f32x4(a, b, 0xEE);  // a's 8, b's 8
  const fvec cd = _mm512_shuffle_f32x4(c, d, 0x44) + _mm512_shuffle_f32x4(c, d, 0xEE);
  fvec t = _mm512_shuffle_f32x4(ab, cd, 0x88) + _mm512_shuffle_f32x4(ab, cd, 0xDD);  // a's 4, b's 4, c's, d's
  t += _mm512_permute_ps(t, 0x4E);  // + lanes (2, 3, 0, 1) of each quarter
  t += _mm512_permute_ps(t, 0xB1);  // + lanes (1, 0, 3, 2)
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), t));
}
inline float hsum(fvec v) { return _mm512_reduce_add_ps(v); }
#else
constexpr int kIntLanes = 8;
typedef __m256i ivec;
typedef __m256 fvec;
// The first n lanes of a vector, 1 <= n <= kIntLanes, as AVX2's masked loads take them: made once,
// used by many scale loads. AVX2 has no masked 16-bit load, so fewer than 8 float16 scales come
// as n / 2 pairs by a masked 32-bit load (vpmaskmovd reads no masked-off element, so never past
// the array) and half n - 1 on its own, broadcast and kept in its lane; for even n the pairs hold
// it already and or-ing it again changes nothing. (Copied through a stack buffer instead, they
// cost a memcpy call with every live ymm spilled around it and a store-forwarding stall on the
// buffer's 16-byte reload: 4 to 6x the float32 scales' time a call, measured on an AMD EPYC.)
struct FirstLanes {
  __m256i floats;  // [8] int32: -1 for lanes < n
  __m128i pairs;   // [4] int32: -1 for pairs of halves < n / 2
  __m128i last;    // [8] int16: -1 for half n - 1
  int n;
  explicit FirstLanes(int count)
      : floats(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
        pairs(_mm_cmpgt_epi32(_mm_set1_epi32(count / 2), _mm_setr_epi32(0, 1, 2, 3))),
        last(_mm_cmpeq_epi16(_mm_set1_epi16(static_cast<int16_t>(count - 1)), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7))),
        n(count) {}
};
// The first n scales (float32, or float16 bits) as floats, zeros after.
inline fvec load_scales(const float* p, const FirstLanes& f) { return _mm256_maskload_ps(p, f.floats); }
inline fvec load_scales(const uint16_t* p, const FirstLanes& f) {
  if (f.n == kIntLanes) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m128i pairs = _mm_maskload_epi32(reinterpret_cast<const int*>(p), f.pairs);
  const __m128i last = _mm_and_si128(_mm_set1_epi16(static_cast<int16_t>(p[f.n - 1])), f.last);
  return _mm256_cvtph_ps(_mm_or_si128(pairs, last));
}
inline ivec load_bytes(const uint8_t* p, int64_t n) {  // n is 32 or 16 (a chunk of u4, a group of 16 of u8)
  return n >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                 : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline fvec load_fvec(const float* p) { return _mm256_loadu_ps(p); }
inline ivec load_ivec(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline fvec permute(ivec idx, fvec v) { return _mm256_permutevar8x32_ps(v, idx); }
inline ivec bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
inline ivec srl4(ivec v) { return _mm256_srli_epi16(v, 4); }
inline ivec sll7(ivec v) { return _mm256_slli_epi32(v, 7); }
inline ivec and_(ivec a, ivec b) { return _mm256_and_si256(a, b); }
inline ivec xor_(ivec a, ivec b) { return _mm256_xor_si256(a, b); }
inline fvec cvt(ivec v) { return _mm256_cvtepi32_ps(v); }
inline ivec round_to_int(fvec v) { return _mm256_cvtps_epi32(v); }
inline ivec abs8(ivec c) { return _mm256_abs_epi8(c); }
inline ivec sign_of(ivec x, ivec c) { return _mm256_sign_epi8(x, c); }
inline float max_abs(fvec v) {
  const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.f), v);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
inline int32_t sum_ints(ivec v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}
inline void store_int8(int8_t* p, ivec v) {  // kIntLanes int32, saturated to int8
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
}
inline ivec pair_sums(ivec u, ivec s) { return _mm256_maddubs_epi16(u, s); }
inline ivec add16(ivec a, ivec b) { return _mm256_add_epi16(a, b); }
inline ivec add32(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline ivec widen(ivec pairs, int16_t w) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(w)); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVnni = true;
inline ivec dot(ivec acc, ivec u, ivec s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
constexpr bool kVnni = true;
inline ivec dot(ivec acc, ivec u, ivec s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
constexpr bool kVnni = false;
inline ivec dot(ivec acc, ivec u, ivec s) { return add32(acc, widen(pair_sums(u, s), 1)); }
#endif
inline __m128 hsum4(fvec a, fvec b, fvec c, fvec d) {
  const fvec t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // a b c d (low 4), again (high 4)
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
inline float hsum(fvec v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

constexpr int kVecBytes = 4 * kIntLanes;  // code bytes per vector: 4 per int32 lane

}  // namespace

#endif  // __AVX2__
