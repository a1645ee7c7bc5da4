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
// A bf16 state as 2*kF bf16 <-> two float vectors, in an element order of our choosing (callers
// keep their other operands in the same order; dot products do not care about order). Widening a
// bf16 is a 16-bit shift and narrowing an integer rounding of the high half, so the order is the
// one that costs the fewest shuffles and shifts on each ISA. Every narrowing rounds to nearest
// even and turns every NaN into 0x7fc0, like c10::BFloat16; the *_no_nan forms skip the NaN
// handling for values the caller has proved are not NaN, with the same bits otherwise.
#define CUSTOM_OPS_HAVE_BF16_LANES 1

#if defined(CPU_CAPABILITY_AVX512)
// "Lane order": interleaving the words with zeros (unpacklo/unpackhi) gives the two float
// vectors in one instruction each, and packus_epi32 of the rounded high halves is its exact
// inverse (per 128-bit lane: words 0-3 -> lo, 4-7 -> hi).
using iVec = __m512i;
inline iVec lane_load(const void* p) { return _mm512_loadu_si512(p); }
inline iVec lane_load(const void* p, int64_t n) {
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
}
inline void lane_store(void* p, iVec x) { _mm512_storeu_si512(p, x); }
inline void lane_store(void* p, int64_t n, iVec x) {
  _mm512_mask_storeu_epi16(p, static_cast<__mmask32>((1ull << n) - 1), x);
}
inline iVec i_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline fVec as_f(iVec a) { return _mm512_castsi512_ps(a); }
inline iVec as_i(const fVec& a) { return _mm512_castps_si512(a); }

// Scalar math: bits(x) + 0x7fff + ((bits(x) >> 16) & 1), >> 16 (round to nearest even), result
// in the low 16 bits of each 32-bit lane; right for every x but NaN (the add can carry a NaN's
// mantissa into the exponent or the sign bit).
inline iVec round_bf16_no_nan(const fVec& x) {
  const iVec bits = as_i(x);
  const iVec lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), i_set1(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, i_set1(0x7fff)), lsb), 16);
}
// Scalar math: isnan(x) ? 0x7fc0 : round_bf16_no_nan(x)
inline iVec round_bf16(const fVec& x) {
  return _mm512_mask_mov_epi32(round_bf16_no_nan(x), _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                               i_set1(0x7fc0));
}
inline void widen_bf16_lanes(iVec x, fVec& lo, fVec& hi) {
  lo = as_f(_mm512_unpacklo_epi16(_mm512_setzero_si512(), x));
  hi = as_f(_mm512_unpackhi_epi16(_mm512_setzero_si512(), x));
}
inline iVec narrow_bf16_lanes(const fVec& lo, const fVec& hi) {
  return _mm512_packus_epi32(round_bf16(lo), round_bf16(hi));
}
inline iVec narrow_bf16_lanes_no_nan(const fVec& lo, const fVec& hi) {
#if defined(__AVX512BF16__)
  // vcvtne2ps2bf16 rounds to nearest even like round_bf16 except for NaNs (it keeps the payload)
  // and fp32 denormals (it flushes them to zero): vectors holding either take the integer path.
  // Checked over all 2^32 inputs by tests/cpp/bf16_narrow_exhaustive.cpp.
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // fpclass: QNaN | denormal | SNaN
  if ((_mm512_fpclass_ps_mask(lo, kNanOrDenormal) | _mm512_fpclass_ps_mask(hi, kNanOrDenormal)) ==
      0) {
    // Words 0-15 from lo, 16-31 from hi: in 64-bit blocks, lane order's blocks 0, 2, 4, 6, 1, 3,
    // 5, 7. Put them back.
    const __m512i words = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    return _mm512_permutexvar_epi64(_mm512_set_epi64(7, 3, 6, 2, 5, 1, 4, 0), words);
  }
  return narrow_bf16_lanes(lo, hi);
#else
  return _mm512_packus_epi32(round_bf16_no_nan(lo), round_bf16_no_nan(hi));
#endif
}
#else
// AVX2: "pair order": the 32-bit lane i holds elements 2i (low word) and 2i+1 (high word);
// lo = lane << 16, hi = lane & 0xffff0000, and narrowing blends the rounded high words back. One
// shift or blend per vector where unpack/packus orders need shuffles and more shifts, which
// compete for the same two ports on current x86 cores.
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
inline iVec i_set1(int32_t v) { return _mm256_set1_epi32(v); }
inline fVec as_f(iVec a) { return _mm256_castsi256_ps(a); }
inline iVec as_i(const fVec& a) { return _mm256_castps_si256(a); }

// Round to nearest even, result in the HIGH 16 bits of each 32-bit lane (the low bits are
// garbage). Scalar math: bits + 0x8000 - (low 17 bits == 0x8000), which carries into the high
// half exactly when bits + 0x7fff + ((bits >> 16) & 1) does (a tie rounds up only from an odd
// value), without a shift. Right for every x but NaN.
inline iVec round_bf16_high_no_nan(const fVec& x) {
  const iVec bits = as_i(x);
  const iVec low17 = _mm256_and_si256(bits, i_set1(0x1ffff));
  const iVec tie_even = _mm256_cmpeq_epi32(low17, i_set1(0x8000));  // all ones: subtract 1
  return _mm256_add_epi32(_mm256_add_epi32(bits, i_set1(0x8000)), tie_even);
}
// Scalar math: isnan(x) ? 0x7fc0 : round_bf16_high_no_nan(x), in the high half.
inline iVec round_bf16_high(const fVec& x) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(round_bf16_high_no_nan(x), i_set1(0x7fc00000),
                            _mm256_castps_si256(nan));
}
inline iVec pair_words(iVec lo_high, iVec hi_high) {
  return _mm256_blend_epi16(_mm256_srli_epi32(lo_high, 16), hi_high, 0xAA);
}
inline void widen_bf16_lanes(iVec x, fVec& lo, fVec& hi) {
  lo = as_f(_mm256_slli_epi32(x, 16));
  hi = as_f(_mm256_and_si256(x, i_set1(static_cast<int32_t>(0xffff0000u))));
}
inline iVec narrow_bf16_lanes(const fVec& lo, const fVec& hi) {
  return pair_words(round_bf16_high(lo), round_bf16_high(hi));
}
inline iVec narrow_bf16_lanes_no_nan(const fVec& lo, const fVec& hi) {
  return pair_words(round_bf16_high_no_nan(lo), round_bf16_high_no_nan(hi));
}
#endif

// 2*kF bf16 (or the first n, the rest read as 0) to two float vectors in this ISA's order, and
// back.
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
inline void store_bf16_lanes_no_nan(c10::BFloat16* p, const fVec& lo, const fVec& hi) {
  lane_store(p, narrow_bf16_lanes_no_nan(lo, hi));
}
#endif // CPU_CAPABILITY_AVX2 || CPU_CAPABILITY_AVX512

} // namespace
} // namespace CPU_CAPABILITY
} // namespace custom_ops::cpu
