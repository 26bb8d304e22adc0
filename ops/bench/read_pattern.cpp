// The best a one-row decode step's quantized linears could stream on this machine: reads alone
// (512-bit loads summed), in SmolLM2 Q4_1's shapes per layer (q/k/v 346 KB, o 207 KB, gate/up
// 1.1 MB, down 553 KB, codes and scales; 30 layers, 66 MB, more than the L3), each chunk split
// between the threads as the kernels split a call:
//   p  one OpenMP region per chunk, as the kernels run (a fork and a join per call);
//   b  one region for all, a barrier after each chunk (what a persistent team would pay: a call
//      needs the one before it whole);
//   n  one region, no barrier (not a valid step: the threads drift apart);
//   w  one region, the 66 MB in two halves (two long streams: the most a pass could read).
// A flush of FLUSH_MIB (default 256: more than the L3 of most machines) runs before each of 7
// repetitions; 0 reads the weights warm, from whatever cache holds them.
//
//   g++ -O3 -march=native -fopenmp ops/bench/read_pattern.cpp -o /tmp/read_pattern
//   for m in p b n w; do /tmp/read_pattern $m; done       # /tmp/read_pattern p 0: warm
//
// (docs/benchmarks/cpu-isa.md: the linears of a recorded program against this.)

#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// Thread t of nt's share of the n bytes at p (whole lines), summed into acc.
static inline __m512i read_share(const uint8_t* p, int64_t n, int t, int nt, __m512i acc) {
  const int64_t per = n / nt / 64 * 64;
  for (int64_t i = t * per; i < (t + 1) * per; i += 64) acc = _mm512_add_epi64(acc, _mm512_load_si512(p + i));
  return acc;
}

int main(int argc, char** argv) {
  const int64_t chunks[4] = {345600, 207360, 1105920, 552960};  // bytes, codes+scales approx
  const int layers = 30;
  int64_t total = 0;
  for (int l = 0; l < layers; ++l) for (int c = 0; c < 4; ++c) total += chunks[c];
  uint8_t* buf = (uint8_t*)aligned_alloc(64, total + 4096);
  memset(buf, 1, total);
  // a second buffer to flush caches between reps
  const int64_t flush_bytes = (argc > 2 ? atoll(argv[2]) : 256) << 20;
  uint8_t* flush = (uint8_t*)aligned_alloc(64, flush_bytes + 64);
  memset(flush, 2, flush_bytes);
  const char mode = argc > 1 ? argv[1][0] : 'p';
  const bool whole = mode == 'w';
  for (int rep = 0; rep < 7; ++rep) {
    volatile int64_t sink = 0;
    for (int64_t i = 0; i < flush_bytes; i += 64) sink += flush[i];
    auto t0 = std::chrono::steady_clock::now();
    __m512i acc_all = _mm512_setzero_si512();
    if (whole) {
#pragma omp parallel
      {
        __m512i acc = _mm512_setzero_si512();
        acc = read_share(buf, total, omp_get_thread_num(), omp_get_num_threads(), acc);
#pragma omp critical
        acc_all = _mm512_add_epi64(acc_all, acc);
      }
    } else if (mode == 'b' || mode == 'n') {
      const bool bar = mode == 'b';
#pragma omp parallel
      {
        __m512i acc = _mm512_setzero_si512();
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t off = 0;
        for (int l = 0; l < layers; ++l)
          for (int c = 0; c < 4; ++c) {
            acc = read_share(buf + off, chunks[c], t, nt, acc);
            if (bar) {
#pragma omp barrier
            }
            off += chunks[c];
          }
#pragma omp critical
        acc_all = _mm512_add_epi64(acc_all, acc);
      }
    } else {
      int64_t off = 0;
      for (int l = 0; l < layers; ++l)
        for (int c = 0; c < 4; ++c) {
#pragma omp parallel
          {
            __m512i acc = read_share(buf + off, chunks[c], omp_get_thread_num(), omp_get_num_threads(), _mm512_setzero_si512());
#pragma omp critical
            acc_all = _mm512_add_epi64(acc_all, acc);
          }
          off += chunks[c];
        }
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("%c: %.3f ms, %.1f GB/s\n", mode, s * 1e3, total / s / 1e9);
  }
}
