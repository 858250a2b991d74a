// How one core reads memory, the floor of the cpu backend's decode: a plain sum of 151 MB as N sequential streams
// side by side, and of fp32 K and V caches (18 requests of 1,024 positions, 8 kv heads of D 128: 4 KiB a position,
// 16 positions a cache page, the pages shuffled) in the orders a decode unit of every kv head can read a tile of 64
// positions: each position's 4 KiB in turn, 8 consecutive positions side by side (512 B of each per head); or 8 runs
// of 8 consecutive positions side by side, a position of each run per pass; with software prefetch of the slice that
// comes next to the same pass and head, or without. No arithmetic but adds: prints GB/s and ns per KiB.
//   gcc -O2 -mavx2 bench/read_streams.c -o /tmp/read_streams && /tmp/read_streams
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define POS 4096   // bytes of a position: 8 heads x 128 fp32
#define SLICE 512  // a head's part of it
#define PAGE 16    // positions a cache page
#define SEQ 1024
#define NSEQ 18
#define TILE 64
#define RUNS 8

static __m256 acc0, acc1;
static void sum(const char* p, size_t n) {
  for (size_t c = 0; c < n; c += 64) {
    acc0 = _mm256_add_ps(acc0, _mm256_load_ps((const float*)(p + c)));
    acc1 = _mm256_add_ps(acc1, _mm256_load_ps((const float*)(p + c + 32)));
  }
}
static void prefetch(const char* p, size_t n) {
  for (size_t c = 0; c < n; c += 64) _mm_prefetch(p + c, _MM_HINT_T1);
}
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Reads the tile at rows (and prefetches next's, when given) in `order`: 0 groups of 8 positions, 1 runs.
static void read_tile(const char* const* rows, const char* const* next, int order) {
  if (order == 0) {
    for (int g = 0; g < TILE; g += 8)
      for (int h = 0; h < POS; h += SLICE) {
        for (int j = g; j < g + 8 && next; j++) prefetch((g + 8 < TILE ? rows[j + 8] : next[j - g]) + h, SLICE);
        for (int j = g; j < g + 8; j++) sum(rows[j] + h, SLICE);
      }
    return;
  }
  const int per_run = TILE / RUNS;
  for (int p = 0; p < per_run; p++)
    for (int h = 0; h < POS; h += SLICE)
      for (int j = p; j < TILE; j += per_run) {
        if (next) prefetch(next[j] + h, SLICE);
        sum(rows[j] + h, SLICE);
      }
}

int main(void) {
  const size_t pages = NSEQ * SEQ / PAGE, bytes = pages * PAGE * POS;
  char* k = aligned_alloc(4096, bytes);
  char* v = aligned_alloc(4096, bytes);
  for (size_t i = 0; i < bytes / 4; i++) ((float*)k)[i] = ((float*)v)[i] = 1.f;
  static int perm[NSEQ * SEQ / PAGE];
  for (size_t i = 0; i < pages; i++) perm[i] = (int)i;
  srand(1);
  for (size_t i = pages - 1; i > 0; i--) {
    const size_t j = (size_t)rand() % (i + 1);
    const int t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
  printf("| read of 151 MB, one core | GB/s | ns per KiB |\n|---|---:|---:|\n");
  const int streams[] = {1, 2, 4, 8, 16, 32};
  for (int s = 0; s < 6; s++) {
    const int n = streams[s];
    const size_t per = bytes / n / 4096 * 4096;
    double best = 1e9;
    for (int rep = 0; rep < 4; rep++) {
      const double t = now();
      for (size_t off = 0; off < per; off += SLICE)
        for (int i = 0; i < n; i++) sum(k + i * per + off, SLICE);
      const double dt = now() - t;
      best = dt < best ? dt : best;
    }
    printf("| %d sequential streams | %.1f | %.1f |\n", n, per * n / best / 1e9, best / (per * n / 1024) * 1e9);
  }
  static const char *k_rows[SEQ], *v_rows[SEQ];
  const char* names[] = {"positions whole, 8 side by side", "8 runs of 8 positions"};
  for (int order = 0; order < 2; order++)
    for (int pf = 0; pf < 2; pf++) {
      double best = 1e9;
      for (int rep = 0; rep < 4; rep++) {
        const double t = now();
        for (int s = 0; s < NSEQ; s++) {
          for (int j = 0; j < SEQ; j++) {
            const size_t at = ((size_t)perm[s * (SEQ / PAGE) + j / PAGE] * PAGE + j % PAGE) * POS;
            k_rows[j] = k + at;
            v_rows[j] = v + at;
          }
          // As the kernel: K of a tile (V's prefetched beside it), then V (the next tile's K beside it).
          for (int t0 = 0; t0 < SEQ; t0 += TILE) {
            read_tile(k_rows + t0, pf ? v_rows + t0 : NULL, order);
            read_tile(v_rows + t0, pf ? k_rows + (t0 + TILE < SEQ ? t0 + TILE : t0) : NULL, order);
          }
        }
        const double dt = now() - t;
        best = dt < best ? dt : best;
      }
      printf("| K/V caches, %s%s | %.1f | %.1f |\n", names[order], pf ? ", prefetch" : "", 2 * bytes / best / 1e9,
             best / (2 * bytes / 1024) * 1e9);
    }
  float out[8];
  _mm256_storeu_ps(out, _mm256_add_ps(acc0, acc1));
  return out[0] == 0.5f;  // keeps the sums
}
