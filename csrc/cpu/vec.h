// Per-ISA helpers of the CPU kernel: the few vector operations at::vec does not offer (or offers
// more slowly), each with an AVX-512 and an AVX2 specialisation, so that kernel_impl.h reads as
// math. Included by kernel_impl.h only, once per CPU_CAPABILITY (see setup.py).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers self-initialise their "undefined" vectors (_mm512_undefined_ps), which
// -Wall reports as uninitialised wherever at::vec or this file inlines such an intrinsic (GCC bug
// 105593, fixed in 12.3). Silenced for those headers only: they are first included here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace custom_ops::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t kF = fVec::size();

// Horizontal sum of one vector.
inline float hsum(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, v);
#else
  float lanes[kF];
  v.store(lanes);
  float sum = 0.f;
  for (int64_t l = 0; l < kF; ++l) {
    sum += lanes[l];
  }
  return sum;
#endif
}

// Scalar math: out[r] = sum_l v[r][l], r < 4.
// On AVX2/AVX-512 the four sums are formed together (a transpose-and-add tree): about a third of
// the shuffles and adds of four separate reductions, which matter next to the few FMAs per row.
#if defined(CPU_CAPABILITY_AVX512)
inline void hsum4(const fVec* v, float* out) {
  // Per 128-bit lane: ab = [a0+a2, b0+b2, a1+a3, b1+b3], likewise cd; then [a, b, c, d].
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  __m512 t = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  // Add the four 128-bit lanes.
  t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
  _mm_storeu_ps(out, _mm512_castps512_ps128(t));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline void hsum4(const fVec* v, float* out) {
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
  const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}
#else
inline void hsum4(const fVec* v, float* out) {
  for (int r = 0; r < 4; ++r) {
    out[r] = hsum(v[r]);
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// bf16 in "lane order": 2*kF bf16 <-> two float vectors. Widening a bf16 is a 16-bit shift, so
// interleaving the words with zeros (unpacklo/unpackhi) gives the two float vectors in one
// instruction each, and packus_epi32 of the rounded high halves is its exact inverse. The element
// order inside the two vectors differs from memory order (per 128-bit lane: words 0-3 -> lo,
// 4-7 -> hi); callers keep their other operands in the same order.
#define CUSTOM_OPS_HAVE_BF16_LANES 1

#if defined(CPU_CAPABILITY_AVX512)
using iVec = __m512i;
inline iVec lane_load(const void* p) { return _mm512_loadu_si512(p); }
inline iVec lane_load(const void* p, int64_t n) {
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
}
inline void lane_store(void* p, iVec x) { _mm512_storeu_si512(p, x); }
inline void lane_store(void* p, int64_t n, iVec x) {
  _mm512_mask_storeu_epi16(p, static_cast<__mmask32>((1ull << n) - 1), x);
}
inline iVec i_zero() { return _mm512_setzero_si512(); }
inline iVec i_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline iVec i_unpacklo16(iVec a, iVec b) { return _mm512_unpacklo_epi16(a, b); }
inline iVec i_unpackhi16(iVec a, iVec b) { return _mm512_unpackhi_epi16(a, b); }
inline iVec i_srli(iVec a, int n) { return _mm512_srli_epi32(a, n); }
inline iVec i_and(iVec a, iVec b) { return _mm512_and_si512(a, b); }
inline iVec i_add(iVec a, iVec b) { return _mm512_add_epi32(a, b); }
inline iVec i_packus32(iVec a, iVec b) { return _mm512_packus_epi32(a, b); }
inline fVec as_f(iVec a) { return _mm512_castsi512_ps(a); }
inline iVec as_i(const fVec& a) { return _mm512_castps_si512(a); }
// Scalar math: isnan(x) ? 0x7fc0 (quiet NaN) : rounded
inline iVec keep_nan(iVec rounded, const fVec& x) {
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), i_set1(0x7fc0));
}
#else
using iVec = __m256i;
inline iVec lane_load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline iVec lane_load(const void* p, int64_t n) {
  alignas(32) uint16_t buf[16] = {0};
  std::memcpy(buf, p, n * sizeof(uint16_t));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}
inline void lane_store(void* p, iVec x) { _mm256_storeu_si256(static_cast<__m256i*>(p), x); }
inline void lane_store(void* p, int64_t n, iVec x) {
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), x);
  std::memcpy(p, buf, n * sizeof(uint16_t));
}
inline iVec i_zero() { return _mm256_setzero_si256(); }
inline iVec i_set1(int32_t v) { return _mm256_set1_epi32(v); }
inline iVec i_unpacklo16(iVec a, iVec b) { return _mm256_unpacklo_epi16(a, b); }
inline iVec i_unpackhi16(iVec a, iVec b) { return _mm256_unpackhi_epi16(a, b); }
inline iVec i_srli(iVec a, int n) { return _mm256_srli_epi32(a, n); }
inline iVec i_and(iVec a, iVec b) { return _mm256_and_si256(a, b); }
inline iVec i_add(iVec a, iVec b) { return _mm256_add_epi32(a, b); }
inline iVec i_packus32(iVec a, iVec b) { return _mm256_packus_epi32(a, b); }
inline fVec as_f(iVec a) { return _mm256_castsi256_ps(a); }
inline iVec as_i(const fVec& a) { return _mm256_castps_si256(a); }
// Scalar math: isnan(x) ? 0x7fc0 (quiet NaN) : rounded
inline iVec keep_nan(iVec rounded, const fVec& x) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(rounded, i_set1(0x7fc0), _mm256_castps_si256(nan));
}
#endif

// Scalar math: bits(x) + 0x7fff + ((bits(x) >> 16) & 1), >> 16 (round to nearest even), result
// in the low 16 bits of each 32-bit lane. NaN must stay NaN: the add can carry a NaN's mantissa
// into the sign bit.
inline iVec round_bf16(const fVec& x) {
  const iVec bits = as_i(x);
  const iVec lsb = i_and(i_srli(bits, 16), i_set1(1));
  return keep_nan(i_srli(i_add(i_add(bits, i_set1(0x7fff)), lsb), 16), x);
}

inline void widen_bf16_lanes(iVec x, fVec& lo, fVec& hi) {
  lo = as_f(i_unpacklo16(i_zero(), x));
  hi = as_f(i_unpackhi16(i_zero(), x));
}
inline iVec narrow_bf16_lanes(const fVec& lo, const fVec& hi) {
  return i_packus32(round_bf16(lo), round_bf16(hi));
}

// 2*kF bf16 (or the first n, the rest read as 0) to two float vectors in lane order, and back.
inline void load_bf16_lanes(const c10::BFloat16* p, fVec& lo, fVec& hi) {
  widen_bf16_lanes(lane_load(p), lo, hi);
}
inline void load_bf16_lanes(const c10::BFloat16* p, int64_t n, fVec& lo, fVec& hi) {
  widen_bf16_lanes(lane_load(p, n), lo, hi);
}
inline void store_bf16_lanes(c10::BFloat16* p, const fVec& lo, const fVec& hi) {
  lane_store(p, narrow_bf16_lanes(lo, hi));
}
inline void store_bf16_lanes(c10::BFloat16* p, int64_t n, const fVec& lo, const fVec& hi) {
  lane_store(p, n, narrow_bf16_lanes(lo, hi));
}
#endif // CPU_CAPABILITY_AVX2 || CPU_CAPABILITY_AVX512

} // namespace
} // namespace CPU_CAPABILITY
} // namespace custom_ops::cpu
