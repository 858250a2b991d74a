// The FMA rate of one core, the arithmetic floor of the cpu backend's decode: a (key, kv head) of D 128 with 4 query
// rows is 64 FMAs of 16 fp32 lanes (scores and P V), 128 of 8 lanes.
//
// Independent chains of FMAs in registers (no loads or stores), 512-bit where the compiler targets AVX-512, else
// 256-bit; prints ns per FMA instruction and per 1,024 lanes (one (key, kv head)).
//   gcc -O2 -mavx512f bench/fma_rate.c -o /tmp/fma_rate && /tmp/fma_rate      (or -mavx2 -mfma)
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#ifdef __AVX512F__
typedef __m512 V;
#define LANES 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#else
typedef __m256 V;
#define LANES 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#endif

#define STEPS 100000000L
// 12 chains: past the FMA latency (4 cycles) times the pipes (2), within AVX2's 16 registers with b and c.
#define CHAINS 12
#define ALL(F) F(a0) F(a1) F(a2) F(a3) F(a4) F(a5) F(a6) F(a7) F(a8) F(a9) F(a10) F(a11)
#define DECLARE(x) V x = SET1(1.0f);
#define CHAIN(x) x = FMA(x, b, c);
#define KEEP(x) __asm__ volatile("" : "+x"(x));  // in a register, and its chain not folded away
#define ADD(x) x +

int main(void) {
  const V b = SET1(1.0000001f), c = SET1(1e-7f);
  ALL(DECLARE)
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long k = 0; k < STEPS; ++k) {
    ALL(CHAIN)
    ALL(KEEP)
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const double ns = ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / ((double)CHAINS * STEPS);
  float sink[LANES];
  *(V*)sink = ALL(ADD) SET1(0.0f);
  printf("%d-lane FMA: %.3f ns each, %.1f ns per 1,024 lanes (%g)\n", LANES, ns, ns * 1024 / LANES, sink[0]);
  return 0;
}
