// The 16 sums of a 4 x 4 block of 16-lane vectors in one transposing reduction (halves, quarters, then within 128-bit
// blocks across rows): 45 shuffles and adds instead of 16 x 7, for the few-rows scores (attend_inplace.cpp).
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

// Lane 4 c + r of the result: the sum of acc[r][c]'s lanes.
static inline __m512 sums_4x4(const __m512 (*acc)[4]) {
  __m512 t[4][2];
  for (int r = 0; r < 4; ++r)
    for (int h = 0; h < 2; ++h) {
      const __m512 a = acc[r][2 * h], b = acc[r][2 * h + 1];
      t[r][h] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
  __m512 u[4];
  for (int r = 0; r < 4; ++r)
    u[r] = _mm512_add_ps(_mm512_shuffle_f32x4(t[r][0], t[r][1], 0x88), _mm512_shuffle_f32x4(t[r][0], t[r][1], 0xDD));
  const __m512 v01 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 v23 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(v01), _mm512_castps_pd(v23))),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(v01), _mm512_castps_pd(v23))));
}
#endif
