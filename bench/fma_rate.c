// The product rates of one core, the arithmetic floor of the cpu backend's decode: a (key, kv head) of D 128 with 4
// query rows is 1,024 products (scores and P V): 64 FMAs of 16 fp32 lanes, 128 of 8 lanes, 32 vdpbf16ps of 32 bf16
// pairs (AVX512-BF16: decode over a bf16 cache), or an eighth of one AMX tile product (tdpbf16ps, 16 x 16 x 32).
//
// Independent chains in registers (no loads or stores): FMAs 512-bit where the compiler targets AVX-512, else 256-bit,
// then vdpbf16ps and tdpbf16ps where it targets AVX512-BF16 and AMX-BF16 (the flags the CPU reports: avx512_bf16,
// amx_bf16). Prints ns per instruction and per 1,024 products (one (key, kv head)).
//   gcc -O2 -mavx512f bench/fma_rate.c -o /tmp/fma_rate && /tmp/fma_rate      (or -mavx2 -mfma;
//   with -mavx512bf16, -mamx-tile -mamx-bf16 where the CPU has them)
#include <immintrin.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

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

static struct timespec t0;
static void start(void) { clock_gettime(CLOCK_MONOTONIC, &t0); }
// ns per instruction since start(), over count instructions.
static double ns_each(double count) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / count;
}

static void report(const char* name, double ns, int products, float sink) {
  printf("%s: %.3f ns each, %.1f ns per 1,024 products (%g)\n", name, ns, ns * 1024 / products, sink);
}

// CHAINS independent chains x = STEP(x), timed; reported as name, with its products per instruction.
#define TIME_CHAINS(STEP, name, products)              \
  do {                                                 \
    ALL(DECLARE)                                       \
    start();                                           \
    for (long k = 0; k < STEPS; ++k) {                 \
      ALL(STEP)                                        \
      ALL(KEEP)                                        \
    }                                                  \
    const double ns = ns_each((double)CHAINS * STEPS); \
    float sink[LANES];                                 \
    *(V*)sink = ALL(ADD) SET1(0.0f);                   \
    report(name, ns, products, sink[0]);               \
  } while (0)

#ifdef __AMX_BF16__
// Tile products of 16 x 32 by 32 x 16 bf16 into 16 x 16 fp32: four independent accumulator tiles.
static void tile_products(void) {
  struct {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
  } __attribute__((aligned(64))) config;
  static unsigned short ones[16 * 32] __attribute__((aligned(64)));
  static float sums[16 * 16] __attribute__((aligned(64)));
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA (Linux 5.16 on)
    printf("tdpbf16ps: tile data not permitted by the OS\n");
    return;
  }
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  __asm__ volatile("" : : "r"(&config) : "memory");  // the stores above: ldtilecfg reads them
  _tile_loadconfig(&config);
  for (int i = 0; i < 16 * 32; ++i) ones[i] = 0x3f80;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  const long steps = STEPS / 50;
  start();
  for (long k = 0; k < steps; ++k) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
  const double ns = ns_each(4.0 * steps);
  _tile_stored(0, sums, 64);
  _tile_release();
  report("tdpbf16ps", ns, 16 * 16 * 32, sums[0]);
}
#endif

int main(void) {
  const V b = SET1(1.0000001f), c = SET1(1e-7f);
  char name[32];
  snprintf(name, sizeof name, "%d-lane FMA", LANES);
  TIME_CHAINS(CHAIN, name, LANES);
#ifdef __AVX512BF16__
  // 32 products of bf16 pairs summed into 16 fp32 lanes: times 1 and 2^-24.
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80), tiny = (__m512bh)_mm512_set1_epi16(0x3380);
#define DOT(x) x = _mm512_dpbf16_ps(x, ones, tiny);
  TIME_CHAINS(DOT, "vdpbf16ps", 32);
#endif
#ifdef __AMX_BF16__
  tile_products();
#endif
  return 0;
}
