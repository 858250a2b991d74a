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

// The fp32 bits of a byte's raw value.
template <typename C>
constexpr uint32_t raw_bits(uint8_t byte) {
  return static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(byte))) << Fp8<C>::shift & Fp8<C>::mask;
}

// A cache element as few-rows units read it: its value, or (fp8) its raw value.
template <typename C>
inline float raw_value(C x) {
  if constexpr (is_fp8<C>) {
    return c10::bit_cast<float>(raw_bits<C>(x.x));
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

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512VBMI__)
// With AVX512-VBMI, 64 bytes widen at once, to the same raw values, by byte look-ups (vpermb: a table of 64 bytes,
// indexed by each byte's low 6 bits). A raw value's bytes 0 and 1 are zero, its byte 2 is a function of the byte's
// low bits and its byte 3 of its high bits (sign, exponent), which a 16-bit shift brings down: the bits it brings in
// from the next byte lie above the ones the table reads (its entries repeat). A load, a shift and two look-ups per
// 64 values, then one two-table permutation per 16 that places bytes 2 and 3: fewer than load_raw's 3 per 16, but
// more shuffles.
constexpr int WIDE_VECS = 4;  // vectors load_raw_wide fills

template <typename C>
struct RawBytes {
  static constexpr int high_shift = 24 - Fp8<C>::shift;  // the byte's bit that lands on bit 24
  static_assert((Fp8<C>::mask & 0xFFFFu) == 0 && high_shift <= 6);
  alignas(64) uint8_t low[64] = {}, high[64] = {};  // byte 2 by the byte's low bits; byte 3 by its high bits
  constexpr RawBytes() {
    for (int i = 0; i < 64; ++i) {
      low[i] = raw_bits<C>(i) >> 16 & 0xFF;
      high[i] = raw_bits<C>(i << high_shift & 0xFF) >> 24;
    }
  }
};

// For the 4 vectors of 16 raw values: byte 2 of value j from `low` (index 16 * vector + j), byte 3 from `high`
// (64 more); bytes 0 and 1 are zeroed by the mask.
struct RawPlaces {
  static constexpr uint64_t mask = 0xCCCCCCCCCCCCCCCCull;
  alignas(64) uint8_t index[4][64] = {};
  constexpr RawPlaces() {
    for (int v = 0; v < 4; ++v)
      for (int i = 0; i < 64; ++i) index[v][i] = i % 4 == 2 ? 16 * v + i / 4 : 64 + 16 * v + i / 4;
  }
};

// WIDE_VECS * VEC raw fp8 values, out[v] holding values v * VEC ..: load_raw's, bit for bit.
template <typename C>
inline void load_raw_wide(const C* p, Vec* out) {
  static constexpr RawBytes<C> bytes{};
  static constexpr RawPlaces places{};
  const __m512i b = _mm512_loadu_si512(p);
  const __m512i low = _mm512_permutexvar_epi8(b, _mm512_load_si512(bytes.low));
  const __m512i high =
      _mm512_permutexvar_epi8(_mm512_srli_epi16(b, RawBytes<C>::high_shift), _mm512_load_si512(bytes.high));
  for (int v = 0; v < 4; ++v) {
    const __m512i index = _mm512_load_si512(places.index[v]);
    out[v] = _mm512_castsi512_ps(_mm512_maskz_permutex2var_epi8(RawPlaces::mask, low, index, high));
  }
}
#else
constexpr int WIDE_VECS = 1;
template <typename C>
inline void load_raw_wide(const C* p, Vec* out) {
  out[0] = load_raw(p);
}
#endif

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
