// Per-ISA building blocks of the CPU kernel. Included by kernel_impl.h only, once per
// CPU_CAPABILITY (see setup.py).
//
// Every variant computes the same bits (tests/test_cpu_kernel.py compares them). So the kernel
// works on one fixed unit, a block of 16 state elements held as 16 float lanes (lanes 0-7 "lo",
// 8-15 "hi"), whatever the vector width: one __m512 on AVX-512, two __m256 on AVX2, an array in
// the portable code. Every lane operation rounds once (fmadd is fused everywhere), every dot
// product accumulates lane-wise over blocks and ends in the same tree (sum_rows), and every
// stored NaN is the canonical quiet NaN, so nothing depends on the width or on which operand's
// NaN payload an instruction keeps.
//
// Which state element sits in which lane is the state dtype's "element order" (StateIo): the
// identity for fp32 and fp16; for bf16 the pair order, lo lane i = element 2i and hi lane i =
// element 2i + 1, in which AVX2 widens and narrows with one shift or blend per vector. The kernel
// keeps q and k in the same order, so s[t] always meets k[t].
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers self-initialise their "undefined" vectors (_mm512_undefined_ps), which
// -Wall reports as uninitialised wherever this file inlines such an intrinsic (GCC bug 105593,
// fixed in 12.3). Silenced for those headers only: they are first included here.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#endif

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(CPU_CAPABILITY_AVX512)
#include "cpu/bf16_avx512.h"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace custom_ops::cpu {
namespace CPU_CAPABILITY {
namespace {

// State elements per block.
constexpr int64_t kBlock = 16;
// The one NaN the kernel stores (fp32 0x7fc00000, bf16 0x7fc0, fp16 0x7e00).
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

#if defined(CPU_CAPABILITY_AVX512)
struct Blk {
  __m512 v;
};
inline Blk blk_zero() { return {_mm512_setzero_ps()}; }
inline Blk blk_set1(float x) { return {_mm512_set1_ps(x)}; }
inline Blk blk_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void blk_store(float* p, const Blk& a) { _mm512_storeu_ps(p, a.v); }
inline Blk blk_mul(const Blk& a, const Blk& b) { return {_mm512_mul_ps(a.v, b.v)}; }
// a * b + c, one rounding.
inline Blk blk_fmadd(const Blk& a, const Blk& b, const Blk& c) {
  return {_mm512_fmadd_ps(a.v, b.v, c.v)};
}
inline Blk blk_and(const Blk& a, const Blk& m) { return {_mm512_and_ps(a.v, m.v)}; }
// Lane l of the result is lane idx[l] of a (idx: 16 lane numbers).
inline Blk blk_permute(const Blk& a, const int32_t idx[kBlock]) {
  return {_mm512_permutexvar_ps(_mm512_loadu_si512(idx), a.v)};
}
inline Blk blk_canonical_nan(const Blk& a) {
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  return {_mm512_mask_mov_ps(a.v, nan, _mm512_set1_ps(kNaN))};
}
// lo + hi, lane-wise.
inline __m256 blk_fold(const Blk& a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
}
// Makes the compiler hold a in a register of its own here (code only, no instruction): a loaded
// block then becomes the addend an FMA overwrites, rather than a memory operand for which GCC
// copies another operand into a spare register, one more of 32 in a four-row group.
inline void blk_in_register(Blk& a) {
#if defined(__AVX512F__)
  asm("" : "+v"(a.v));
#endif
}
#elif defined(CPU_CAPABILITY_AVX2)
struct Blk {
  __m256 lo, hi;
};
inline Blk blk_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Blk blk_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Blk blk_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void blk_store(float* p, const Blk& a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline Blk blk_mul(const Blk& a, const Blk& b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}
inline Blk blk_fmadd(const Blk& a, const Blk& b, const Blk& c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Blk blk_and(const Blk& a, const Blk& m) {
  return {_mm256_and_ps(a.lo, m.lo), _mm256_and_ps(a.hi, m.hi)};
}
inline Blk blk_permute(const Blk& a, const int32_t idx[kBlock]) {
  // vpermps reads an index's low three bits: each half picks from lo and from hi, then blends
  // where the index is 8 or more.
  const auto half = [&a](__m256i i) {
    const __m256 from_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(i, _mm256_set1_epi32(7)));
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(a.lo, i), _mm256_permutevar8x32_ps(a.hi, i),
                            from_hi);
  };
  return {half(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx))),
          half(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + 8)))};
}
inline __m256 canonical_nan(__m256 x) {
  return _mm256_blendv_ps(x, _mm256_set1_ps(kNaN), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
inline Blk blk_canonical_nan(const Blk& a) { return {canonical_nan(a.lo), canonical_nan(a.hi)}; }
inline __m256 blk_fold(const Blk& a) { return _mm256_add_ps(a.lo, a.hi); }
#else
struct Blk {
  float x[kBlock];
};
inline Blk blk_zero() { return Blk{}; }
inline Blk blk_set1(float v) {
  Blk r;
  for (int l = 0; l < kBlock; ++l) r.x[l] = v;
  return r;
}
inline Blk blk_load(const float* p) {
  Blk r;
  std::memcpy(r.x, p, sizeof(r.x));
  return r;
}
inline void blk_store(float* p, const Blk& a) { std::memcpy(p, a.x, sizeof(a.x)); }
inline Blk blk_mul(const Blk& a, const Blk& b) {
  Blk r;
  for (int l = 0; l < kBlock; ++l) r.x[l] = a.x[l] * b.x[l];
  return r;
}
#if defined(__FP_FAST_FMAF)
// The instruction set has a fused multiply-add (AArch64, ...): std::fma is that instruction.
inline float fma_exact(float a, float b, float c) { return std::fma(a, b, c); }
#else
// a * b + c rounded once, without an FMA instruction (the x86-64 baseline has none, and libm's
// fmaf is a call, in software on such CPUs). The product of two floats is exact in double;
// the double sum is made round-to-odd (TwoSum gives its exact error e; an inexact sum is moved
// to the odd neighbour towards zero), and rounding a round-to-odd value with 53 >= 24 + 2 bits
// to float gives the correctly rounded result (Boldo & Melquiond). Infinite or NaN sums are left
// alone. The kernel files are built with -ffp-contract=off, so p + dc stays an addition.
inline float fma_exact(float a, float b, float c) {
  const double p = static_cast<double>(a) * static_cast<double>(b);
  const double dc = static_cast<double>(c);
  const double s = p + dc;
  const double bb = s - p;
  const double e = (p - (s - bb)) + (dc - bb);
  uint64_t bits, ebits;
  std::memcpy(&bits, &s, sizeof(bits));
  std::memcpy(&ebits, &e, sizeof(ebits));
  // e of the other sign: s was rounded away from zero, and its odd neighbour towards zero is one
  // below in magnitude (branch-free, as the SSE2 form below).
  const uint64_t inexact = (e != 0.0) & (std::fabs(s) <= std::numeric_limits<double>::max());
  bits = (bits - (((bits ^ ebits) >> 63) & inexact)) | inexact;
  double odd;
  std::memcpy(&odd, &bits, sizeof(odd));
  return static_cast<float>(odd);
}
#endif
#if !defined(__FP_FAST_FMAF) && defined(__SSE2__)
// fma_exact on two lanes at once with SSE2 (the x86-64 baseline); the same steps.
inline __m128d fma_exact_pd(__m128d p, __m128d dc) {
  const __m128d s = _mm_add_pd(p, dc);
  const __m128d bb = _mm_sub_pd(s, p);
  const __m128d e = _mm_add_pd(_mm_sub_pd(p, _mm_sub_pd(s, bb)), _mm_sub_pd(dc, bb));
  const __m128d abs_s = _mm_andnot_pd(_mm_set1_pd(-0.0), s);
  const __m128d finite = _mm_cmple_pd(abs_s, _mm_set1_pd(std::numeric_limits<double>::max()));
  const __m128d inexact = _mm_and_pd(_mm_cmpneq_pd(e, _mm_setzero_pd()), finite);
  const __m128i one = _mm_and_si128(_mm_castpd_si128(inexact), _mm_set1_epi64x(1));
  const __m128i bits = _mm_castpd_si128(s);
  const __m128i away = _mm_and_si128(
      _mm_srli_epi64(_mm_xor_si128(bits, _mm_castpd_si128(e)), 63), one);
  return _mm_castsi128_pd(_mm_or_si128(_mm_sub_epi64(bits, away), one));
}
inline __m128 fma_exact_ps(__m128 a, __m128 b, __m128 c) {
  const __m128d lo = fma_exact_pd(_mm_mul_pd(_mm_cvtps_pd(a), _mm_cvtps_pd(b)), _mm_cvtps_pd(c));
  const __m128d hi = fma_exact_pd(
      _mm_mul_pd(_mm_cvtps_pd(_mm_movehl_ps(a, a)), _mm_cvtps_pd(_mm_movehl_ps(b, b))),
      _mm_cvtps_pd(_mm_movehl_ps(c, c)));
  return _mm_movelh_ps(_mm_cvtpd_ps(lo), _mm_cvtpd_ps(hi));
}
inline Blk blk_fmadd(const Blk& a, const Blk& b, const Blk& c) {
  Blk r;
  for (int l = 0; l < kBlock; l += 4) {
    _mm_storeu_ps(r.x + l, fma_exact_ps(_mm_loadu_ps(a.x + l), _mm_loadu_ps(b.x + l),
                                        _mm_loadu_ps(c.x + l)));
  }
  return r;
}
#else
inline Blk blk_fmadd(const Blk& a, const Blk& b, const Blk& c) {
  Blk r;
  for (int l = 0; l < kBlock; ++l) r.x[l] = fma_exact(a.x[l], b.x[l], c.x[l]);
  return r;
}
#endif
inline Blk blk_and(const Blk& a, const Blk& m) {
  uint32_t x[kBlock], y[kBlock];
  std::memcpy(x, a.x, sizeof(x));
  std::memcpy(y, m.x, sizeof(y));
  for (int l = 0; l < kBlock; ++l) x[l] &= y[l];
  Blk r;
  std::memcpy(r.x, x, sizeof(x));
  return r;
}
inline Blk blk_permute(const Blk& a, const int32_t idx[kBlock]) {
  Blk r;
  for (int l = 0; l < kBlock; ++l) r.x[l] = a.x[idx[l]];
  return r;
}
inline Blk blk_canonical_nan(const Blk& a) {
  Blk r;
  for (int l = 0; l < kBlock; ++l) r.x[l] = std::isnan(a.x[l]) ? kNaN : a.x[l];
  return r;
}
#endif
#if !defined(CPU_CAPABILITY_AVX512)
inline void blk_in_register(Blk&) {}
#endif

// out[r] = the sum of v[r]'s 16 lanes, r < R, in one order for every ISA: with L[i] = lo[i] +
// hi[i], ((L0 + L2) + (L1 + L3)) + ((L4 + L6) + (L5 + L7)).
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// The tree above for four rows at once (transpose-and-add: about a third of the shuffles and
// adds of four separate reductions).
inline __m128 hsum4(const __m256* v) {
  // Per 128-bit lane: ab = [a0+a2, b0+b2, a1+a3, b1+b3], likewise cd; then [a, b, c, d].
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(v[0], v[1]), _mm256_unpackhi_ps(v[0], v[1]));
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(v[2], v[3]), _mm256_unpackhi_ps(v[2], v[3]));
  const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
// The same tree for one row: pairs (i, i + 2), then (i, i + 1), then the two 128-bit halves.
inline float hsum1(__m256 L) {
  const __m256 t = _mm256_add_ps(L, _mm256_permute_ps(L, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m256 u = _mm256_add_ps(t, _mm256_permute_ps(t, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
}
template <int R>
inline void sum_rows(const Blk* v, float* out) {
  static_assert(R >= 1 && R <= 4, "at most 4 rows");
  if constexpr (R == 1) {
    out[0] = hsum1(blk_fold(v[0]));
    return;
  }
  __m256 f[4];
  for (int r = 0; r < 4; ++r) {
    f[r] = blk_fold(v[r < R ? r : 0]);
  }
  float all[4];
  _mm_storeu_ps(all, hsum4(f));
  for (int r = 0; r < R; ++r) {
    out[r] = all[r];
  }
}
#else
template <int R>
inline void sum_rows(const Blk* v, float* out) {
  for (int r = 0; r < R; ++r) {
    float L[8];
    for (int i = 0; i < 8; ++i) L[i] = v[r].x[i] + v[r].x[8 + i];
    out[r] = ((L[0] + L[2]) + (L[1] + L[3])) + ((L[4] + L[6]) + (L[5] + L[7]));
  }
}
#endif

// Four rows' scalars (a group's sums, deltas and outputs) as one vector, so that a group's tail
// is a few vector operations instead of four rows of scalar code. Each lane computes what the
// scalar code computes for its row (one rounding per operation; conversions exact or rounding
// to nearest even, NaN stored as the canonical NaN), so the bits are the same.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
struct Quad {
  __m128 v;
};
inline Quad quad_set1(float x) { return {_mm_set1_ps(x)}; }
inline Quad quad_sub(const Quad& a, const Quad& b) { return {_mm_sub_ps(a.v, b.v)}; }
inline Quad quad_mul(const Quad& a, const Quad& b) { return {_mm_mul_ps(a.v, b.v)}; }
inline void quad_store(float* p, const Quad& a) { _mm_storeu_ps(p, a.v); }
// sum_rows<4>(v, ..) as a Quad.
inline Quad quad_sum_rows(const Blk* v) {
  const __m256 f[4] = {blk_fold(v[0]), blk_fold(v[1]), blk_fold(v[2]), blk_fold(v[3])};
  return {hsum4(f)};
}
// Whether all four lanes are finite (a NaN compares false).
inline bool quad_finite(const Quad& a) {
  const __m128 magnitude = _mm_andnot_ps(_mm_set1_ps(-0.f), a.v);
  const __m128 finite =
      _mm_cmp_ps(magnitude, _mm_set1_ps(std::numeric_limits<float>::infinity()), _CMP_LT_OQ);
  return _mm_movemask_ps(finite) == 0xf;
}
// p[0], p[stride], p[2 stride], p[3 stride] of a 16-bit type, as 4 words.
template <typename T>
inline __m128i quad_words(const T* p, int64_t stride) {
  static_assert(sizeof(T) == 2, "16-bit values");
  if (stride == 1) {
    return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  }
  return _mm_setr_epi16(static_cast<int16_t>(p[0].x), static_cast<int16_t>(p[stride].x),
                        static_cast<int16_t>(p[2 * stride].x),
                        static_cast<int16_t>(p[3 * stride].x), 0, 0, 0, 0);
}
// Four values, widened exactly.
template <typename T>
inline Quad quad_load(const T* p, int64_t stride) {
  const __m128i w = quad_words(p, stride);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return {_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(w), 16))};
  } else {
    return {_mm_cvtph_ps(w)};
  }
}
// p[0, 4) = the four lanes, rounded to nearest even, NaN as the canonical NaN.
template <typename T>
inline void quad_store(T* p, const Quad& a) {
  const __m128 x =
      _mm_blendv_ps(a.v, _mm_set1_ps(kNaN), _mm_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  __m128i w;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // As round_bf16_high_no_nan (the canonical NaN rounds to 0x7fc0); then the high words.
    const __m128i bits = _mm_castps_si128(x);
    const __m128i odd = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
    const __m128i high = _mm_add_epi32(_mm_add_epi32(bits, _mm_set1_epi32(0x7fff)), odd);
    w = _mm_packus_epi32(_mm_srli_epi32(high, 16), _mm_setzero_si128());
  } else {
    w = _mm_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), w);
}
#else
struct Quad {
  float x[4];
};
inline Quad quad_set1(float v) { return {{v, v, v, v}}; }
inline Quad quad_sub(const Quad& a, const Quad& b) {
  Quad r;
  for (int l = 0; l < 4; ++l) r.x[l] = a.x[l] - b.x[l];
  return r;
}
inline Quad quad_mul(const Quad& a, const Quad& b) {
  Quad r;
  for (int l = 0; l < 4; ++l) r.x[l] = a.x[l] * b.x[l];
  return r;
}
inline void quad_store(float* p, const Quad& a) { std::memcpy(p, a.x, sizeof(a.x)); }
inline Quad quad_sum_rows(const Blk* v) {
  Quad r;
  sum_rows<4>(v, r.x);
  return r;
}
inline bool quad_finite(const Quad& a) {
  bool finite = true;
  for (int l = 0; l < 4; ++l) finite = finite && std::isfinite(a.x[l]);
  return finite;
}
template <typename T>
inline Quad quad_load(const T* p, int64_t stride) {
  Quad r;
  for (int l = 0; l < 4; ++l) r.x[l] = static_cast<float>(p[l * stride]);
  return r;
}
template <typename T>
inline void quad_store(T* p, const Quad& a) {
  for (int l = 0; l < 4; ++l) p[l] = static_cast<T>(std::isnan(a.x[l]) ? kNaN : a.x[l]);
}
#endif

// State blocks: kBlock elements of S (or the first n < kBlock; the rest read as 0) to a Blk in
// S's element order, and back, rounding to nearest even. store turns every NaN into the canonical
// one; store_finite may assume no lane is NaN (the caller has proved it) and gives store's bits
// for such values.
template <typename S>
struct StateIo;

// Whether the kernel stores two full NaN-free blocks of S at once (StateIo<S>::store_pair_finite:
// the blocks at p and p + kBlock), where one instruction serves both.
template <typename S>
constexpr bool kPairStores = false;

// What a group's paired stores leave to be checked after them (PairCheckFor<S>::type, passed to
// each store_pair_finite): whether the group must be stored again by the exact rounding
// (RowGroups::store_pairs_again). Nothing, unless a state type's stores say otherwise.
struct NoPairCheck {
  static constexpr bool redo() { return false; }
};
template <typename S>
struct PairCheckFor {
  using type = NoPairCheck;
};

#if defined(CPU_CAPABILITY_AVX2)
// bf16 rounding in integers, the result in the HIGH 16 bits of each 32-bit lane (the low bits are
// garbage): bits + 0x7fff + (bit 16 of bits) carries into the high half when the low half is over
// 0x8000, or is 0x8000 (a tie) from an odd value. Four integer operations, like the form with a
// compare (bits + 0x8000 - (low 17 bits == 0x8000)), which took 3-12 % more ns per row in L1/L2 on
// AMD Zen 3 (docs/bench_ab_avx2_round.txt). Right for every x but NaN; the NaN forms put 0x7fc0
// there, like c10::BFloat16.
inline __m256i round_bf16_high_no_nan(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd);
}
inline __m256i round_bf16_high(__m256 x) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(round_bf16_high_no_nan(x), _mm256_set1_epi32(0x7fc00000),
                            _mm256_castps_si256(nan));
}
// 16 bf16 in pair order from the rounded high halves of lo (even elements) and hi (odd ones).
inline __m256i pair_words(__m256i lo_high, __m256i hi_high) {
  return _mm256_blend_epi16(_mm256_srli_epi32(lo_high, 16), hi_high, 0xAA);
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
inline __mmask16 first_n16(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }

template <>
struct StateIo<float> {
  static inline void load(const float* p, Blk& a) { a.v = _mm512_loadu_ps(p); }
  static inline void load(const float* p, int64_t n, Blk& a) {
    a.v = _mm512_maskz_loadu_ps(first_n16(n), p);
  }
  static inline void store_finite(float* p, const Blk& a) { _mm512_storeu_ps(p, a.v); }
  static inline void store(float* p, const Blk& a) { store_finite(p, blk_canonical_nan(a)); }
  static inline void store(float* p, int64_t n, const Blk& a) {
    _mm512_mask_storeu_ps(p, first_n16(n), blk_canonical_nan(a).v);
  }
};

// Pair order (element 2i in lane i, element 2i + 1 in lane 8 + i) with one word permute of the
// 16 loaded words (bf16_avx512.h).
inline Blk widen_bf16(__m256i w) { return {bf16_avx512::widen(w)}; }
// The rounded high words of a block picked into memory order (element 2i from lane i, element
// 2i + 1 from lane 8 + i) by one word permute. With the rounding on all 16 lanes at once, about
// half the instructions of rounding two 256-bit halves.
inline __m256i bf16_words(__m512i high) {
  // Word 2i <- word 2i + 1 (lane i), word 2i + 1 <- word 17 + 2i (lane 8 + i).
  const __m512i order = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, (31 << 16) | 15, (29 << 16) | 13,
                                         (27 << 16) | 11, (25 << 16) | 9, (23 << 16) | 7,
                                         (21 << 16) | 5, (19 << 16) | 3, (17 << 16) | 1);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi16(order, high));
}
// bf16 rounding in integers, the result in the HIGH 16 bits of each 32-bit lane (bf16_avx512.h):
// the form of AVX2's round_bf16_high_no_nan above, with no compare into a mask. Right for every x
// but NaN.
inline __m512i round_bf16_high_no_nan(const Blk& a) { return bf16_avx512::round_high_no_nan(a.v); }
inline __m256i narrow_bf16(const Blk& a) {
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  return bf16_words(
      _mm512_mask_mov_epi32(round_bf16_high_no_nan(a), nan, _mm512_set1_epi32(0x7fc00000)));
}
// The rounded high words of two blocks (a: elements [0, 16), b: [16, 32)) picked into memory
// order by one two-source word permute, for one 64-byte store: half the permutes of bf16_words on
// each block. On AMD Zen 4, 2-8 % fewer ns per bf16 row in L1/L2 at a clock read 3.2-3.6 GHz,
// no difference at 1.9-2.7, from DRAM within a few points of rmw
// (docs/bench_ab_zen4_bf16_pairs.txt).
inline __m512i bf16_words_pair(__m512i a_high, __m512i b_high) {
  return bf16_avx512::words_pair(a_high, b_high);
}
inline __m256i narrow_bf16_finite(const Blk& a) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16 rounds to nearest even like round_bf16_high_no_nan except for NaNs (it keeps the
  // payload) and fp32 denormals (it flushes them): blocks holding either take narrow_bf16, so
  // this gives narrow_bf16's bits for every input, NaNs included (the guard costs the fast path
  // nothing more). Checked over all 2^32 inputs by tests/cpp/bf16_narrow_exhaustive.cpp.
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // fpclass: QNaN | denormal | SNaN
  if (_mm512_fpclass_ps_mask(a.v, kNanOrDenormal) == 0) {
    // Words [e0, e2, .., e14, e1, e3, .., e15] back to memory order.
    const __m256i words = (__m256i)_mm512_cvtneps_pbh(a.v);
    const __m256i order = _mm256_setr_epi16(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    return _mm256_permutexvar_epi16(order, words);
  }
  return narrow_bf16(a);
#else
  return bf16_words(round_bf16_high_no_nan(a));
#endif
}
#if defined(__AVX512BF16__)
// A paired bf16 store by vcvtne2ps2bf16 rounds both blocks to nearest even in one instruction,
// but reads an fp32 denormal as zero. In a NaN-free block only denormals and zeros narrow to a
// word of zero magnitude (a normal value narrows to a normal bf16 or to Inf), so a store with no
// such word has the integer rounding's bits; `low` keeps the smallest magnitude (times two, so
// the sign drops out) of every word stored since the check began, and a group whose stores held
// a zero is stored again by the integer rounding. Checked over all 2^32 inputs by
// tests/cpp/bf16_narrow_exhaustive.cpp.
struct Bf16PairCheck {
  __m512i low = _mm512_set1_epi32(-1);
  bool redo() const { return _mm512_testn_epi16_mask(low, low) != 0; }
};
template <>
struct PairCheckFor<c10::BFloat16> {
  using type = Bf16PairCheck;
};
// The bf16 words of two blocks (a: elements [0, 16), b: [16, 32)) in memory order: rounded by
// one vcvtne2ps2bf16 (a's lanes to words 0-15, b's to 16-31, each in the pair order) and picked
// into memory order by one word permute (element 2i is lane i of its block, 2i + 1 lane 8 + i).
// A denormal reads as zero: see Bf16PairCheck.
inline __m512i bf16_cvt_pair(const Blk& a, const Blk& b) {
  const __m512i order = _mm512_set_epi32(
      (31 << 16) | 23, (30 << 16) | 22, (29 << 16) | 21, (28 << 16) | 20, (27 << 16) | 19,
      (26 << 16) | 18, (25 << 16) | 17, (24 << 16) | 16, (15 << 16) | 7, (14 << 16) | 6,
      (13 << 16) | 5, (12 << 16) | 4, (11 << 16) | 3, (10 << 16) | 2, (9 << 16) | 1, 8 << 16);
  return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(b.v, a.v));
}
#endif
template <>
struct StateIo<c10::BFloat16> {
  using S = c10::BFloat16;
  static inline void load(const S* p, Blk& a) {
    a = widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline void load(const S* p, int64_t n, Blk& a) {
    a = widen_bf16(_mm256_maskz_loadu_epi16(first_n16(n), p));
  }
  static inline void store(S* p, const Blk& a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16(a));
  }
  static inline void store(S* p, int64_t n, const Blk& a) {
    _mm256_mask_storeu_epi16(p, first_n16(n), narrow_bf16(a));
  }
  static inline void store_finite(S* p, const Blk& a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16_finite(a));
  }
  static inline void store_pair_finite(S* p, const Blk& a, const Blk& b,
                                       PairCheckFor<S>::type& check) {
#if defined(__AVX512BF16__)
    const __m512i words = bf16_cvt_pair(a, b);
    check.low = _mm512_min_epu16(check.low, _mm512_add_epi16(words, words));
    _mm512_storeu_si512(p, words);
#else
    (void)check;
    store_pair_exact(p, a, b);
#endif
  }
  // store_pair_finite's bits without its check.
  static inline void store_pair_exact(S* p, const Blk& a, const Blk& b) {
    _mm512_storeu_si512(p, bf16_words_pair(round_bf16_high_no_nan(a), round_bf16_high_no_nan(b)));
  }
};
template <>
constexpr bool kPairStores<c10::BFloat16> = true;

template <>
struct StateIo<c10::Half> {
  using S = c10::Half;
  static constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  static inline void load(const S* p, Blk& a) {
    a.v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline void load(const S* p, int64_t n, Blk& a) {
    a.v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_n16(n), p));
  }
  static inline void store_finite(S* p, const Blk& a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a.v, kRound));
  }
  static inline void store(S* p, const Blk& a) { store_finite(p, blk_canonical_nan(a)); }
  static inline void store(S* p, int64_t n, const Blk& a) {
    _mm256_mask_storeu_epi16(p, first_n16(n), _mm512_cvtps_ph(blk_canonical_nan(a).v, kRound));
  }
};
#elif defined(CPU_CAPABILITY_AVX2)
// Partial blocks go through a zero-filled buffer (tails only).
template <typename S>
inline void copy_in(const S* p, int64_t n, S (&buf)[kBlock]) {
  std::memset(buf, 0, sizeof(buf));
  std::memcpy(buf, p, n * sizeof(S));
}

template <>
struct StateIo<float> {
  static inline void load(const float* p, Blk& a) { a = blk_load(p); }
  static inline void load(const float* p, int64_t n, Blk& a) {
    float buf[kBlock];
    copy_in(p, n, buf);
    a = blk_load(buf);
  }
  static inline void store_finite(float* p, const Blk& a) { blk_store(p, a); }
  static inline void store(float* p, const Blk& a) { blk_store(p, blk_canonical_nan(a)); }
  static inline void store(float* p, int64_t n, const Blk& a) {
    float buf[kBlock];
    blk_store(buf, blk_canonical_nan(a));
    std::memcpy(p, buf, n * sizeof(float));
  }
};

template <>
struct StateIo<c10::BFloat16> {
  using S = c10::BFloat16;
  static inline void widen(__m256i x, Blk& a) {
    a.lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    a.hi = _mm256_castsi256_ps(_mm256_and_si256(x, high));
  }
  static inline void load(const S* p, Blk& a) {
    widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), a);
  }
  static inline void load(const S* p, int64_t n, Blk& a) {
    S buf[kBlock];
    copy_in(p, n, buf);
    load(buf, a);
  }
  static inline void store(S* p, const Blk& a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        pair_words(round_bf16_high(a.lo), round_bf16_high(a.hi)));
  }
  static inline void store(S* p, int64_t n, const Blk& a) {
    S buf[kBlock];
    store(buf, a);
    std::memcpy(p, buf, n * sizeof(S));
  }
  static inline void store_finite(S* p, const Blk& a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        pair_words(round_bf16_high_no_nan(a.lo), round_bf16_high_no_nan(a.hi)));
  }
};

template <>
struct StateIo<c10::Half> {
  using S = c10::Half;
  static constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  static inline void load(const S* p, Blk& a) {
    a.lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    a.hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  }
  static inline void load(const S* p, int64_t n, Blk& a) {
    S buf[kBlock];
    copy_in(p, n, buf);
    load(buf, a);
  }
  static inline void store_finite(S* p, const Blk& a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.lo, kRound));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(a.hi, kRound));
  }
  static inline void store(S* p, const Blk& a) { store_finite(p, blk_canonical_nan(a)); }
  static inline void store(S* p, int64_t n, const Blk& a) {
    S buf[kBlock];
    store(buf, a);
    std::memcpy(p, buf, n * sizeof(S));
  }
};
#else
// Portable: the element orders above, one element at a time; c10's conversions round to nearest
// even like the vector ones.
template <typename S>
struct StateIo {
  // Lane of element e (the element order).
  static constexpr int lane(int e) {
    return std::is_same_v<S, c10::BFloat16> ? (e % 2) * 8 + e / 2 : e;
  }
  static inline void load(const S* p, int64_t n, Blk& a) {
    a = blk_zero();
    for (int e = 0; e < n; ++e) a.x[lane(e)] = static_cast<float>(p[e]);
  }
  static inline void load(const S* p, Blk& a) { load(p, kBlock, a); }
  static inline void store(S* p, int64_t n, const Blk& a) {
    for (int e = 0; e < n; ++e) {
      const float x = a.x[lane(e)];
      p[e] = static_cast<S>(std::isnan(x) ? kNaN : x);
    }
  }
  static inline void store(S* p, const Blk& a) { store(p, kBlock, a); }
  static inline void store_finite(S* p, const Blk& a) { store(p, kBlock, a); }
};
#endif

} // namespace
} // namespace CPU_CAPABILITY
} // namespace custom_ops::cpu
