// How much of one core's arithmetic hides under its reads from memory: the floor under the cpu backend's decode share
// of `python -m bench.bound`'s read. K and V caches of the op section's decode case (18,432 positions of 8 kv heads, D
// 128; 16 positions a cache page, the pages shuffled) read with F FMAs on each 64 B line as it arrives (products of
// the line with a register, into 8 accumulators: nothing else), in two orders:
//   - in address order, K's bytes then V's: the read of bench.bound (a sum of the caches' words);
//   - the kernel's (attend_inplace.cpp): tiles of 64 positions, K then V, as 8 runs of 8 positions side by side, head
//     by head, with the slice that comes next to the same pass and head prefetched beside each one: a slice at a time
//     ahead of reading it, or a line at a time as the same line of the slice read is (the kernel's, Beside).
// A (key, kv head) of 4 query rows is 1,024 products: 64 FMAs of 16 lanes over 1 KiB of fp32 K/V (4 a line) or 512 B
// of bf16 (8 a line, before any widening), or 32 vdpbf16ps over the bf16 bytes (4 a line; rows of their own where
// built with AVX512-BF16). The last-level cache is evicted (twice its size read) before each timed pass, so that
// every pass reads from memory; "in L2" reads 512 KiB again and again (the arithmetic's own rate).
// Prints GB/s of K/V and the share of the read (address order, no products) for each F and order.
//   gcc -O2 -mavx512f -mavx512bf16 -fopenmp bench/overlap.c -o /tmp/overlap && /tmp/overlap bf16  (or -mavx2 -mfma;
//   OMP_NUM_THREADS=2: each thread its share of the requests; an optional second argument: timed passes, 5)
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX512F__
typedef __m512 V;
#define LOAD _mm512_load_ps
#define ADD _mm512_add_ps
#define FMA _mm512_fmadd_ps
#define SET1 _mm512_set1_ps
#else
typedef __m256 V;
#define LOAD _mm256_load_ps
#define ADD _mm256_add_ps
#define FMA _mm256_fmadd_ps
#define SET1 _mm256_set1_ps
#endif
#define LINE_VECS (64 / (int)sizeof(V))

#define HEADS 8
#define PAGE 16
#define SEQ 1024
#define NSEQ 18  // 18,432 positions, as the decode case's 16 requests of 256-2,048
#define TILE 64
#define RUNS 8

static size_t pos_bytes, slice_bytes;  // a position of every kv head; one head's part of it
static V sink;

// The products' instruction: an FMA of 16 (or 8) fp32 lanes, or where built with AVX512-BF16, vdpbf16ps (32 bf16
// pairs; the cpu backend's bf16 decode takes its 1,024 products of a (key, kv head) as 32 of them, 4 a 64 B line).
enum Product { FMAS, DPBF16 };
#ifdef __AVX512BF16__
#define PRODUCT(kind, x, q, acc) \
  ((kind) == DPBF16 ? _mm512_dpbf16_ps(acc, (__m512bh)(x), (__m512bh)(q)) : FMA(x, q, acc))
#else
#define PRODUCT(kind, x, q, acc) FMA(x, q, acc)
#endif

// F products per line of [p, p + n), beside the sum of its words; each line of [beside, beside + n) prefetched as the
// same line of p is read (beside null: none).
static inline __attribute__((always_inline)) void lines(const char* p, size_t n, V* sum, V* acc, const int F,
                                                        const enum Product kind, const char* beside) {
  const V q = SET1(1.0001f);
  for (size_t c = 0; c < n; c += 64) {
    if (beside) _mm_prefetch(beside + c, _MM_HINT_T1);
    for (int i = 0; i < LINE_VECS; i++) {
      const V x = LOAD((const float*)(p + c) + i * (int)(sizeof(V) / 4));
      *sum = ADD(*sum, x);
#pragma GCC unroll 16
      for (int f = i; f < F; f += LINE_VECS) acc[f % 8] = PRODUCT(kind, x, q, acc[f % 8]);
    }
  }
}

// The counts of each kind timed (the rows of the table), each a loop of its own with its products unrolled.
#ifdef __AVX512BF16__
#define COUNTS(X) X(FMAS, 0) X(FMAS, 2) X(FMAS, 4) X(FMAS, 8) X(FMAS, 16) X(DPBF16, 2) X(DPBF16, 4) X(DPBF16, 8)
#else
#define COUNTS(X) X(FMAS, 0) X(FMAS, 2) X(FMAS, 4) X(FMAS, 8) X(FMAS, 16)
#endif

// The sums of a pass: kept across its slices, as the kernel keeps its accumulators in registers (a call a slice, its
// sums started and reduced each time, cut the kernel's order to 55% of the read on a Zen 4 with no products at all).
struct Sums {
  V sum, acc[8];
};

static inline __attribute__((always_inline)) void sums_start(struct Sums* s) {
  s->sum = sink;
  for (int i = 0; i < 8; i++) s->acc[i] = s->sum;
}

static inline __attribute__((always_inline)) void sums_finish(struct Sums* s) {
  for (int i = 0; i < 8; i++) s->sum = ADD(s->sum, s->acc[i]);
  sink = s->sum;
}

// F and kind are constants where this is inlined (pass_as, evict, row).
static inline __attribute__((always_inline)) void read_lines(struct Sums* s, const char* p, size_t n, int F,
                                                             enum Product kind, const char* beside) {
  switch (kind * 100 + F) {
#define CASE(KIND, F)                              \
  case KIND * 100 + F:                             \
    lines(p, n, &s->sum, s->acc, F, KIND, beside); \
    break;
    COUNTS(CASE)
#undef CASE
  }
}

static void prefetch(const char* p, size_t n) {
  for (size_t c = 0; c < n; c += 64) _mm_prefetch(p + c, _MM_HINT_T1);
}

// A tile's rows in the kernel's order, prefetching next's (the same slices of the rows read next): a slice ahead of its
// reads, or line by line.
static inline __attribute__((always_inline)) void read_tile(struct Sums* s, const char* const* rows,
                                                            const char* const* next, int F, enum Product kind,
                                                            int line_by_line) {
  const int per_run = TILE / RUNS;
  for (int p = 0; p < per_run; p++)
    for (size_t h = 0; h < pos_bytes; h += slice_bytes) {
      if (!line_by_line)
        for (int j = p; j < TILE; j += per_run) prefetch(next[j] + h, slice_bytes);
      for (int j = p; j < TILE; j += per_run)
        read_lines(s, rows[j] + h, slice_bytes, F, kind, line_by_line ? next[j] + h : NULL);
    }
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static char *k, *v, *evict_buf;
static size_t bytes, evict_bytes;
static int perm[NSEQ * SEQ / PAGE];

static void evict(void) {
  struct Sums s;
  sums_start(&s);
  read_lines(&s, evict_buf, evict_bytes, 0, FMAS, NULL);
  sums_finish(&s);
}

enum Order { ADDRESS, SLICE_AHEAD, LINE_BY_LINE };

// Each thread reads its share of the requests (in address order: of the caches' bytes).
static inline __attribute__((always_inline)) void pass_as(enum Order order, int F, enum Product kind) {
#pragma omp parallel
  {
    int t = 0, threads = 1;
#ifdef _OPENMP
    t = omp_get_thread_num();
    threads = omp_get_num_threads();
#endif
    struct Sums s;
    sums_start(&s);
    if (order == ADDRESS) {
      const size_t share = bytes / threads / 4096 * 4096, at = t * share, n = t == threads - 1 ? bytes - at : share;
      read_lines(&s, k + at, n, F, kind, NULL);
      read_lines(&s, v + at, n, F, kind, NULL);
    } else {
      const char *k_rows[SEQ], *v_rows[SEQ];
      for (int q = t; q < NSEQ; q += threads) {
        for (int j = 0; j < SEQ; j++) {
          const size_t at = ((size_t)perm[q * (SEQ / PAGE) + j / PAGE] * PAGE + j % PAGE) * pos_bytes;
          k_rows[j] = k + at;
          v_rows[j] = v + at;
        }
        for (int t0 = 0; t0 < SEQ; t0 += TILE) {
          read_tile(&s, k_rows + t0, v_rows + t0, F, kind, order == LINE_BY_LINE);
          read_tile(&s, v_rows + t0, k_rows + (t0 + TILE < SEQ ? t0 + TILE : t0), F, kind, order == LINE_BY_LINE);
        }
      }
    }
#pragma omp critical
    sums_finish(&s);
  }
}

static void pass(enum Order order, int F, enum Product kind) {
  switch (kind * 100 + F) {  // F and kind constants in each copy of the loops
#define CASE(KIND, F)        \
  case KIND * 100 + F:       \
    pass_as(order, F, KIND); \
    break;
    COUNTS(CASE)
#undef CASE
  }
}

static double best_of(int reps, enum Order order, int F, enum Product kind) {
  double best = 1e9;
  for (int rep = 0; rep < reps; rep++) {
    evict();
    const double start = now();
    pass(order, F, kind);
    const double dt = now() - start;
    best = dt < best ? dt : best;
  }
  return best;
}

// A row of the table: F products a line of `kind`, in L2 (512 KiB read again and again) and from memory in each order;
// the first row (no products, address order) is the read the shares are of.
static void row(enum Product kind, int F, size_t lines_per_key, int reps, double* read) {
  const size_t warm = (size_t)512 << 10;
  double in_l2 = 1e9;
  for (int rep = 0; rep < reps; rep++) {
    const double start = now();
    struct Sums s;
    sums_start(&s);
    for (size_t done = 0; done < 2 * bytes; done += warm) read_lines(&s, k, warm, F, kind, NULL);
    sums_finish(&s);
    const double dt = now() - start;
    in_l2 = dt < in_l2 ? dt : in_l2;
  }
  double t[3];
  for (enum Order order = ADDRESS; order <= LINE_BY_LINE; order++) t[order] = best_of(reps, order, F, kind);
  if (*read == 0) *read = t[ADDRESS];
  printf("| %d %sa line | %zu | %.1f", F, kind == DPBF16 ? "vdpbf16ps " : "", F * lines_per_key,
         2 * bytes / in_l2 / 1e9);
  for (enum Order order = ADDRESS; order <= LINE_BY_LINE; order++) printf(" | %.1f", 2 * bytes / t[order] / 1e9);
  for (enum Order order = ADDRESS; order <= LINE_BY_LINE; order++) printf(" | %.0f%%", 100 * *read / t[order]);
  printf(" |\n");
}

static size_t llc_bytes(void) {
  FILE* f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
  size_t kib = 0;
  if (f) {
    if (fscanf(f, "%zuK", &kib) != 1) kib = 0;
    fclose(f);
  }
  return kib ? kib * 1024 : (size_t)256 << 20;
}

int main(int argc, char** argv) {
  const int bf16 = argc > 1 && strcmp(argv[1], "bf16") == 0;
  const int reps = argc > 2 ? atoi(argv[2]) : 5;
  pos_bytes = HEADS * 128 * (bf16 ? 2 : 4);
  slice_bytes = pos_bytes / HEADS;
  bytes = (size_t)NSEQ * SEQ * pos_bytes;
  evict_bytes = 2 * llc_bytes();
  k = aligned_alloc(4096, bytes);
  v = aligned_alloc(4096, bytes);
  evict_buf = aligned_alloc(4096, evict_bytes);
  memset(k, 0, bytes);
  memset(v, 0, bytes);
  memset(evict_buf, 0, evict_bytes);
  const int pages = NSEQ * SEQ / PAGE;
  for (int i = 0; i < pages; i++) perm[i] = i;
  srand(1);
  for (int i = pages - 1; i > 0; i--) {
    const int j = rand() % (i + 1), t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  const char* name = bf16 ? "bf16" : "fp32";
  printf(
      "| %s K/V (%zu MB), %d thread(s) | products' instructions per (key, kv head) | GB/s: in L2 | from memory: "
      "address order | "
      "kernel's order, a slice ahead | line by line | share of the read: address order | a slice ahead "
      "| line by line |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
      name, 2 * bytes >> 20, threads);
  const size_t lines_per_key = 2 * pos_bytes / HEADS / 64;
  double read = 0;
#define ROW(KIND, F) \
  if (KIND == FMAS || bf16) row(KIND, F, lines_per_key, reps, &read);
  COUNTS(ROW)
#undef ROW
  float out[sizeof(V) / 4];
  memcpy(out, &sink, sizeof out);
  return out[0] == 0.5f;  // keeps the sums
}
