// The arithmetic floor of the cpu backend's decode loops on an AVX2 CPU, fp8 against bf16 caches.
//
// A few-rows unit (kernels/cpu/paged_attention.cpp: scores_dot, accumulate_pv) widens each 8 cache values to fp32 and
// multiplies them into the 4 query rows of a GQA group: 4 FMAs per 8 values. Each loop below is one step of that:
// 2 keys x 16 dims, 16 FMAs on query rows loaded from L1 and cache values in L1, with the widening of
//   fma:      nothing (fp32 values): the FMAs alone, 8 cycles a step on 2 FMA pipes;
//   bf16:     vpmovzxwd, vpslld (as at::vec loads bf16);
//   fp8:      vpmovsxbd, vpslld, vpand (load_raw: the byte's bits put where fp32's are, exactly);
//   fp8 w16:  the same in 16-bit lanes, then even and odd values apart (vpmovsxbw, vpsllw, vpand; vpslld or vpand):
//             one shift fewer per 16 values, with the head dim's values in another order.
// Times are the best of interleaved rounds, as ratios to the fma loop (this machine is shared).
//   gcc -O2 -mavx2 bench/fp8_widen.c -o /tmp/fp8_widen && /tmp/fp8_widen
#include <stdio.h>
#include <time.h>

#define STEPS 20000000L
#define CLOBBERS \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "memory"

// ymm0..7: accumulators (row r, key c: 2r + c); ymm8..11: widened values (key c, 8 dims h: 8 + 2c + h); ymm12: a
// query row; %1, %2: masks, in registers the compiler picks. The cache values lie at 0(%0) (key 0) and 128(%0) (key 1),
// the query rows at 512(%0).
#define FMAS                                                                                                \
  "vmovups 512(%0), %%ymm12\n vfmadd231ps %%ymm12, %%ymm8, %%ymm0\n vfmadd231ps %%ymm12, %%ymm10, %%ymm1\n" \
  "vmovups 576(%0), %%ymm12\n vfmadd231ps %%ymm12, %%ymm8, %%ymm2\n vfmadd231ps %%ymm12, %%ymm10, %%ymm3\n" \
  "vmovups 640(%0), %%ymm12\n vfmadd231ps %%ymm12, %%ymm8, %%ymm4\n vfmadd231ps %%ymm12, %%ymm10, %%ymm5\n" \
  "vmovups 704(%0), %%ymm12\n vfmadd231ps %%ymm12, %%ymm8, %%ymm6\n vfmadd231ps %%ymm12, %%ymm10, %%ymm7\n" \
  "vmovups 544(%0), %%ymm12\n vfmadd231ps %%ymm12, %%ymm9, %%ymm0\n vfmadd231ps %%ymm12, %%ymm11, %%ymm1\n" \
  "vmovups 608(%0), %%ymm12\n vfmadd231ps %%ymm12, %%ymm9, %%ymm2\n vfmadd231ps %%ymm12, %%ymm11, %%ymm3\n" \
  "vmovups 672(%0), %%ymm12\n vfmadd231ps %%ymm12, %%ymm9, %%ymm4\n vfmadd231ps %%ymm12, %%ymm11, %%ymm5\n" \
  "vmovups 736(%0), %%ymm12\n vfmadd231ps %%ymm12, %%ymm9, %%ymm6\n vfmadd231ps %%ymm12, %%ymm11, %%ymm7\n"

#define BF16(c, h, reg) "vpmovzxwd " #c "*256+" #h "*16(%0), %%ymm" #reg "\n vpslld $16, %%ymm" #reg ", %%ymm" #reg "\n"
#define FP8(c, h, reg)                                                                                                 \
  "vpmovsxbd " #c "*128+" #h "*8(%0), %%ymm" #reg "\n vpslld $20, %%ymm" #reg ", %%ymm" #reg "\n vpand %1, %%ymm" #reg \
  ", %%ymm" #reg "\n"
// Words (sign-extended byte << 4) & 0x87f0: each 32-bit lane's high word is the odd value's fp32 bits (masked by
// 0xffff0000), its low word the even value's (shifted up by 16).
#define FP8_W16(c, even, odd)                                                                                    \
  "vpmovsxbw " #c "*128(%0), %%ymm" #even "\n vpsllw $4, %%ymm" #even ", %%ymm" #even "\n vpand %1, %%ymm" #even \
  ", %%ymm" #even "\n vpand %2, %%ymm" #even ", %%ymm" #odd "\n vpslld $16, %%ymm" #even ", %%ymm" #even "\n"

typedef unsigned v8u __attribute__((vector_size(32)));
#define MASKS(a, b) "x"((v8u){a, a, a, a, a, a, a, a}), "x"((v8u){b, b, b, b, b, b, b, b})

static void run_fma(const char* p) {
  for (long i = 0; i < STEPS; ++i) __asm__ volatile(FMAS::"r"(p), MASKS(0, 0) : CLOBBERS);
}
static void run_bf16(const char* p) {
  for (long i = 0; i < STEPS; ++i)
    __asm__ volatile(BF16(0, 0, 8) BF16(0, 1, 9) BF16(1, 0, 10) BF16(1, 1, 11) FMAS::"r"(p), MASKS(0, 0) : CLOBBERS);
}
static void run_fp8(const char* p) {
  for (long i = 0; i < STEPS; ++i)
    __asm__ volatile(FP8(0, 0, 8) FP8(0, 1, 9) FP8(1, 0, 10) FP8(1, 1, 11) FMAS::"r"(p), MASKS(0x87F00000, 0)
                     : CLOBBERS);
}
static void run_fp8_w16(const char* p) {
  for (long i = 0; i < STEPS; ++i)
    __asm__ volatile(FP8_W16(0, 8, 9) FP8_W16(1, 10, 11) FMAS::"r"(p), MASKS(0x87F087F0, 0xFFFF0000) : CLOBBERS);
}

static double seconds(void (*fn)(const char*), const char* p) {
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  fn(p);
  clock_gettime(CLOCK_MONOTONIC, &b);
  return (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) * 1e-9;
}

int main(void) {
  // Cache values of small normal fp8 / bf16 numbers and small query rows: the accumulators stay finite.
  static char buf[1024] __attribute__((aligned(64)));
  for (int i = 0; i < 512; ++i) buf[i] = (char)(0x30 + i % 7);
  for (int i = 0; i < 64; ++i) ((float*)(buf + 512))[i] = 1e-3f;
  const char* names[] = {"fma", "bf16", "fp8", "fp8 w16"};
  void (*fns[])(const char*) = {run_fma, run_bf16, run_fp8, run_fp8_w16};
  double best[4] = {1e9, 1e9, 1e9, 1e9};
  for (int round = 0; round < 7; ++round)
    for (int i = 0; i < 4; ++i) {
      const double s = seconds(fns[i], buf);
      if (s < best[i]) best[i] = s;
    }
  printf("| widening | time / fma | cycles a step (fma at its bound of 8) | per key and kv head (8 steps) |\n");
  printf("|---|---:|---:|---:|\n");
  for (int i = 0; i < 4; ++i) {
    const double cycles = 8 * best[i] / best[0];
    printf("| %s | %.2f | %.1f | %.0f |\n", names[i], best[i] / best[0], cycles, 8 * cycles);
  }
  return 0;
}
