// fp8 caches (float8_e4m3fn, float8_e5m2) hold saturate(x / scale), one fp32 scale per kv head for k and for v
// (hybrid_ops/fp8.py). Stored by quantize_row, bit for bit as hybrid_ops.fp8.quantize; read one byte per element and
// widened in registers (load_raw), their scales applied to the query rows or scores (k) and to the output (v).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace hybrid_ops::cpu {

// at::vec's fp32 vectors, of VEC values, which the codec widens bytes into and narrows from.
using Vec = at::vec::Vectorized<float>;
constexpr int64_t VEC = Vec::size();

// A byte's raw value, the fp32 of its sign bit and, at the low end of fp32's exponent and mantissa, its other bits, is
// exactly its value / raw_unit (fp32's subnormals mirror fp8's): a sign extension, a shift and a mask. shift: fp32's
// mantissa bits past the format's; raw_unit: 2^(127 - bias).
template <typename C>
struct Fp8 {};
template <>
struct Fp8<at::Float8_e4m3fn> {
  static constexpr int shift = 20, bias = 7;
  static constexpr uint32_t mask = 0x87F00000u;  // sign, 4 exponent and 3 mantissa bits
  static constexpr float raw_unit = 0x1p120f, max = 448.f;
};
template <>
struct Fp8<at::Float8_e5m2> {
  static constexpr int shift = 21, bias = 15;
  static constexpr uint32_t mask = 0x8FE00000u;  // sign, 5 exponent and 2 mantissa bits
  static constexpr float raw_unit = 0x1p112f, max = 57344.f;
};
template <typename C>
constexpr bool is_fp8 = std::is_same_v<C, at::Float8_e4m3fn> || std::is_same_v<C, at::Float8_e5m2>;

// The rows of few-rows units hold raw fp8 values, near fp32's smallest normals. So that products and sums stay normal
// (subnormal results lose bits, and run slowly on some CPUs), the query rows and the probabilities take `lifted` of
// raw_unit each (they are O(1): far from fp32's largest), and the scores and the output the rest. All 1 but for fp8.
template <typename C>
constexpr float raw_unit() {
  if constexpr (is_fp8<C>) {
    return Fp8<C>::raw_unit;
  } else {
    return 1.f;
  }
}
template <typename C>
constexpr float lifted() {
  return is_fp8<C> ? 0x1p64f : 1.f;
}

// A cache element as few-rows units read it: its value, or (fp8) its raw value.
template <typename C>
inline float raw_value(C x) {
  if constexpr (is_fp8<C>) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(x.x))) << Fp8<C>::shift;
    return c10::bit_cast<float>(bits & Fp8<C>::mask);
  } else {
    return static_cast<float>(x);
  }
}

// VEC raw fp8 values: sign-extended bytes (the sign fills the bits the mask clears), shifted into place.
template <typename C>
inline Vec load_raw(const C* p) {
  constexpr auto mask = static_cast<int32_t>(Fp8<C>::mask);
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, Fp8<C>::shift), _mm512_set1_epi32(mask)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, Fp8<C>::shift), _mm256_set1_epi32(mask)));
#else
  float raw[VEC];
  for (int64_t i = 0; i < VEC; ++i) raw[i] = raw_value(p[i]);
  return Vec::loadu(raw);
#endif
}

// x as an fp8 cache of C holds it, as hybrid_ops.fp8.quantize stores it: divided by its kv head's scale in fp32,
// saturated (NaN stays NaN), then rounded to nearest even by c10's conversion.
template <typename C>
inline C quantize(float x, float kv_scale) {
  return C(std::clamp(x / kv_scale, -Fp8<C>::max, Fp8<C>::max));
}

// quantize of n values, VEC at a time, bit for bit: c10's conversion (Float8_e4m3fn.h, Float8_e5m2.h) on vectors.
// Normal values round to nearest even by a bias added to the fp32 bits before the shift; subnormal ones by an fp32
// addition of the power of two whose ulp is the format's smallest subnormal.
template <typename C>
void quantize_row(const float* x, float kv_scale, C* dst, int64_t n) {
  using F = Fp8<C>;
  using IVec = at::vec::Vectorized<int32_t>;
  constexpr int32_t min_normal = (127 - F::bias + 1) << 23, denorm = (127 - F::bias + F::shift + 1) << 23;
  const Vec scale(kv_scale), limit(F::max), denorm_value(c10::bit_cast<float>(denorm));
  const IVec rounding((F::bias - 127) * (1 << 23) + (1 << (F::shift - 1)) - 1);
  const IVec sign_bit(std::numeric_limits<int32_t>::min()), shift(F::shift), one(1), inf(0x7F800000), nan(0x7F);
  int64_t i = 0;
  for (; i + VEC <= n; i += VEC) {
    const IVec bits = at::vec::cast<int32_t>(at::vec::clamp(Vec::loadu(x + i) / scale, -limit, limit));
    const IVec sign = bits & sign_bit, magnitude = bits ^ sign;
    const IVec subnormal = at::vec::cast<int32_t>(at::vec::cast<float>(magnitude) + denorm_value) - IVec(denorm);
    const IVec normal = (magnitude + rounding + ((magnitude >> shift) & one)) >> shift;
    const IVec code = IVec::blendv(IVec::blendv(normal, subnormal, magnitude < IVec(min_normal)), nan, magnitude > inf);
    int32_t codes[VEC];
    (code | (sign >> IVec(24))).store(codes);  // the sign bit copied down to bit 7 and above: the byte's sign
    for (int64_t j = 0; j < VEC; ++j) dst[i + j].x = static_cast<uint8_t>(codes[j]);
  }
  for (; i < n; ++i) dst[i] = quantize<C>(x[i], kv_scale);
}

}  // namespace hybrid_ops::cpu
