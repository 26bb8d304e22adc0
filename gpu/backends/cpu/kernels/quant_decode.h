// Quantized codes to float vectors, in registers: the decoders quant_linear.cpp's float loops
// are written over, one per kind of gpu/quant/weight.py's QuantizedWeight.
//
// A decoder reads one chunk of a weight row at a time (kInputs consecutive inputs, kBytes
// bytes) in kParts parts; part p gives kVecs float vectors of codes, vector j holding inputs
// offset(p, j) .. + kLanes of the chunk:
//   U4    32 inputs in 16 bytes: byte b holds input b (low nibble) and b + 16 (high nibble), so
//         kLanes bytes widen to 32-bit lanes once and give two vectors (& 15, >> 4);
//   U8    16 inputs in 16 bytes, one code per byte;
//   E4M3  16 float8_e4m3fn codes, rebuilt in the float's bits (see decode_e4m3).
// The same code compiles for 16 lanes (AVX-512) and 8 (AVX2): kLanes is vector_math.h's.

#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vector_math.h"

namespace {

typedef uint8_t vbytes __attribute__((vector_size(kLanes)));  // kLanes codes

// kLanes bytes -> kLanes int32 lanes: one vpmovzxbd. GCC 12 lowers __builtin_convertvector of
// bytes to a byte-by-byte insert (about 50 instructions for 16 lanes: the first build of this
// kernel ran at 2 GB/s), so x86 says it with the intrinsic.
inline vi16 widen(const uint8_t* p) {
#if defined(__AVX512F__)
  return (vi16)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return (vi16)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  vbytes b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vi16);
#endif
}

inline v16 to_float(vi16 v) { return __builtin_convertvector(v, v16); }

// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits. Exponent and mantissa moved to bits
// 20..26 sit at the bottom of float32's exponent and the top of its mantissa, so adding 120 to
// the exponent (127 - 7) gives the value of every normal code exactly. Subnormals (exponent 0:
// m * 2^-9) come from an int conversion instead, not from a float32 subnormal times 2^120,
// which a flush-to-zero process (DAZ) would read as 0. The NaN code (0x7f) reads as 480: a
// weight is never NaN.
inline v16 decode_e4m3(vi16 c) {
  const vi16 mag = c & 0x7f;
  const vi16 normal = (mag << 20) + (120 << 23);
  v16 f;
  std::memcpy(&f, &normal, sizeof f);
  f = mag < 8 ? to_float(mag) * (1.f / 512.f) : f;
  vi16 bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits |= (c & 0x80) << 24;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct U4 {
  static constexpr int kInputs = 32, kBytes = 16, kParts = 16 / kLanes, kVecs = 2;
  static int offset(int p, int j) { return j * 16 + p * kLanes; }
  static void decode(const uint8_t* chunk, int p, v16* out) {
    const vi16 z = widen(chunk + p * kLanes);
    out[0] = to_float(z & 15);
    out[1] = to_float(z >> 4);
  }
};

struct U8 {
  static constexpr int kInputs = 16, kBytes = 16, kParts = 16 / kLanes, kVecs = 1;
  static int offset(int p, int) { return p * kLanes; }
  static void decode(const uint8_t* chunk, int p, v16* out) { out[0] = to_float(widen(chunk + p * kLanes)); }
};

struct E4M3 {
  static constexpr int kInputs = 16, kBytes = 16, kParts = 16 / kLanes, kVecs = 1;
  static int offset(int p, int) { return p * kLanes; }
  static void decode(const uint8_t* chunk, int p, v16* out) { out[0] = decode_e4m3(widen(chunk + p * kLanes)); }
};

}  // namespace
