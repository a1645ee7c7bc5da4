// TEST DOUBLE: scalar stand-ins for the AVX-512 intrinsics that csrc/cpu/vec.h (and the c10 headers
// it includes) use, written from Intel's intrinsics guide, so that the avx512 and avx512bf16 code
// of the kernel runs on a CPU without AVX-512. It checks that code's logic (lane orders, masks,
// the vcvtneps2bf16 guard and permute, the paired vcvtne2ps2bf16 stores and their check) against
// the AVX2 kernel, not the silicon: where the CPU has AVX-512, tests/test_cpu_kernel.py compares
// the real variants instead.
//
// Included first by kernel_standin.cpp, built with the AVX2 flags and CPU_CAPABILITY_AVX512; each
// intrinsic name is then defined to its stand-in below.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace standin {

template <typename To, typename From>
inline To bits_as(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To t;
  std::memcpy(&t, &f, sizeof(t));
  return t;
}
struct F16 {
  float v[16];
};
struct I16 {
  int32_t v[16];
};
struct W16 {
  uint16_t v[16];
};
inline F16 lanes(__m512 a) { return bits_as<F16>(a); }
inline I16 lanes(__m512i a) { return bits_as<I16>(a); }
inline W16 lanes(__m256i a) { return bits_as<W16>(a); }
inline __m512 vec(const F16& x) { return bits_as<__m512>(x); }
inline __m512i vec(const I16& x) { return bits_as<__m512i>(x); }
inline __m256i vec(const W16& x) { return bits_as<__m256i>(x); }
inline bool set(unsigned k, int l) { return (k >> l) & 1; }

inline __m512 setzero_ps() { return vec(F16{}); }
inline __m512 set1_ps(float x) {
  F16 r;
  for (float& v : r.v) v = x;
  return vec(r);
}
inline __m512i set1_epi32(int x) {
  I16 r;
  for (int32_t& v : r.v) v = x;
  return vec(r);
}
inline __m512 loadu_ps(const void* p) {
  F16 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return vec(r);
}
inline void storeu_ps(void* p, __m512 a) {
  const F16 x = lanes(a);
  std::memcpy(p, x.v, sizeof(x.v));
}
inline __m512 maskz_loadu_ps(__mmask16 k, const void* p) {
  F16 r{};
  for (int l = 0; l < 16; ++l) {
    if (set(k, l)) std::memcpy(&r.v[l], static_cast<const float*>(p) + l, sizeof(float));
  }
  return vec(r);
}
inline void mask_storeu_ps(void* p, __mmask16 k, __m512 a) {
  const F16 x = lanes(a);
  for (int l = 0; l < 16; ++l) {
    if (set(k, l)) std::memcpy(static_cast<float*>(p) + l, &x.v[l], sizeof(float));
  }
}
inline __m512 mul_ps(__m512 a, __m512 b) {
  F16 x = lanes(a);
  const F16 y = lanes(b);
  for (int l = 0; l < 16; ++l) x.v[l] = x.v[l] * y.v[l];
  return vec(x);
}
inline __m512 fmadd_ps(__m512 a, __m512 b, __m512 c) {
  F16 x = lanes(a);
  const F16 y = lanes(b), z = lanes(c);
  for (int l = 0; l < 16; ++l) x.v[l] = std::fma(x.v[l], y.v[l], z.v[l]);
  return vec(x);
}
inline __m512i and_si512(__m512i a, __m512i b) {
  I16 x = lanes(a);
  const I16 y = lanes(b);
  for (int l = 0; l < 16; ++l) x.v[l] &= y.v[l];
  return vec(x);
}
inline __m512 and_ps(__m512 a, __m512 b) {
  return bits_as<__m512>(and_si512(bits_as<__m512i>(a), bits_as<__m512i>(b)));
}
inline __mmask16 cmp_ps_mask(__m512 a, __m512 b, int predicate) {
  if (predicate != _CMP_UNORD_Q) __builtin_trap();  // the only one vec.h uses
  const F16 x = lanes(a), y = lanes(b);
  unsigned k = 0;
  for (int l = 0; l < 16; ++l) k |= unsigned(std::isnan(x.v[l]) || std::isnan(y.v[l])) << l;
  return static_cast<__mmask16>(k);
}
inline __m256 castps512_ps256(__m512 a) {
  __m256 r;
  std::memcpy(&r, &a, sizeof(r));
  return r;
}
inline __m256 extractf32x8_ps(__m512 a, int imm) {
  __m256 r;
  std::memcpy(&r, reinterpret_cast<const char*>(&a) + 32 * (imm & 1), sizeof(r));
  return r;
}
inline float cvtss_f32(__m512 a) { return lanes(a).v[0]; }
inline __m512 castsi512_ps(__m512i a) { return bits_as<__m512>(a); }
inline __m512i set_epi32(int e15, int e14, int e13, int e12, int e11, int e10, int e9, int e8,
                         int e7, int e6, int e5, int e4, int e3, int e2, int e1, int e0) {
  return vec(I16{{e0, e1, e2, e3, e4, e5, e6, e7, e8, e9, e10, e11, e12, e13, e14, e15}});
}
inline __m512i castps_si512(__m512 a) { return bits_as<__m512i>(a); }
inline __m256i castsi512_si256(__m512i a) {
  __m256i r;
  std::memcpy(&r, &a, 32);
  return r;
}
inline __m512i add_epi32(__m512i a, __m512i b) {
  I16 r = lanes(a);
  const I16 y = lanes(b);
  for (int l = 0; l < 16; ++l) r.v[l] = int32_t(uint32_t(r.v[l]) + uint32_t(y.v[l]));
  return vec(r);
}
// vpsrld: a logical shift right of each lane (n < 32).
inline __m512i srli_epi32(__m512i a, unsigned n) {
  I16 r = lanes(a);
  for (int32_t& v : r.v) v = int32_t(uint32_t(v) >> n);
  return vec(r);
}
inline __m512i mask_mov_epi32(__m512i src, __mmask16 k, __m512i a) {
  I16 r = lanes(src);
  const I16 x = lanes(a);
  for (int l = 0; l < 16; ++l) {
    if (set(k, l)) r.v[l] = x.v[l];
  }
  return vec(r);
}
inline __m512 mask_mov_ps(__m512 src, __mmask16 k, __m512 a) {
  return bits_as<__m512>(mask_mov_epi32(bits_as<__m512i>(src), k, bits_as<__m512i>(a)));
}
// vpermw (512-bit): word j takes word idx[j] & 31 of a.
inline __m512i permutexvar_epi16_512(__m512i idx, __m512i a) {
  uint16_t i[32], x[32], r[32];
  std::memcpy(i, &idx, 64);
  std::memcpy(x, &a, 64);
  for (int j = 0; j < 32; ++j) r[j] = x[i[j] & 31];
  __m512i out;
  std::memcpy(&out, r, 64);
  return out;
}
// vpermt2w (512-bit): word j takes word idx[j] & 31 of a where bit 5 of idx[j] is clear, of b
// where it is set.
inline __m512i permutex2var_epi16(__m512i a, __m512i idx, __m512i b) {
  uint16_t i[32], x[64], r[32];
  std::memcpy(i, &idx, 64);
  std::memcpy(x, &a, 64);
  std::memcpy(x + 32, &b, 64);
  for (int j = 0; j < 32; ++j) r[j] = x[i[j] & 63];
  __m512i out;
  std::memcpy(&out, r, 64);
  return out;
}
inline void storeu_si512(void* p, __m512i a) { std::memcpy(p, &a, 64); }
// vpermw with a zero mask: word j takes word idx[j] & 31 of a where bit j of k is set, else 0.
inline __m512i maskz_permutexvar_epi16(__mmask32 k, __m512i idx, __m512i a) {
  const __m512i p = permutexvar_epi16_512(idx, a);
  uint16_t r[32];
  std::memcpy(r, &p, 64);
  for (int j = 0; j < 32; ++j) {
    if (!((k >> j) & 1u)) r[j] = 0;
  }
  __m512i out;
  std::memcpy(&out, r, 64);
  return out;
}
// The upper half is undefined: filled with a pattern, so code that reads it gives wrong bits.
inline __m512i castsi256_si512(__m256i a) {
  __m512i r;
  std::memset(&r, 0xa5, 64);
  std::memcpy(&r, &a, 32);
  return r;
}
inline __m256i maskz_loadu_epi16(__mmask16 k, const void* p) {
  W16 r{};
  for (int l = 0; l < 16; ++l) {
    if (set(k, l)) std::memcpy(&r.v[l], static_cast<const uint16_t*>(p) + l, 2);
  }
  return vec(r);
}
inline void mask_storeu_epi16(void* p, __mmask16 k, __m256i a) {
  const W16 x = lanes(a);
  for (int l = 0; l < 16; ++l) {
    if (set(k, l)) std::memcpy(static_cast<uint16_t*>(p) + l, &x.v[l], 2);
  }
}
inline __m256i permutexvar_epi16(__m256i idx, __m256i a) {
  const W16 i = lanes(idx), x = lanes(a);
  W16 r;
  for (int l = 0; l < 16; ++l) r.v[l] = x.v[i.v[l] & 15];
  return vec(r);
}
inline __m512i loadu_si512(const void* p) {
  I16 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return vec(r);
}
// vpermps: lane l of the result is lane idx[l] & 15 of a.
inline __m512 permutexvar_ps(__m512i idx, __m512 a) {
  const I16 i = lanes(idx);
  const F16 x = lanes(a);
  F16 r;
  for (int l = 0; l < 16; ++l) r.v[l] = x.v[i.v[l] & 15];
  return vec(r);
}
// F16C's scalar conversions have the same rounding as the 512-bit ones.
inline __m512 cvtph_ps(__m256i a) {
  const W16 x = lanes(a);
  F16 r;
  for (int l = 0; l < 16; ++l) r.v[l] = _cvtsh_ss(x.v[l]);
  return vec(r);
}
inline __m256i cvtps_ph(__m512 a, int rounding) {
  if (rounding != (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)) __builtin_trap();
  const F16 x = lanes(a);
  W16 r;
  for (int l = 0; l < 16; ++l) r.v[l] = _cvtss_sh(x.v[l], _MM_FROUND_TO_NEAREST_INT);
  return vec(r);
}
// vfpclassps: 0x01 QNaN, 0x02 +0, 0x04 -0, 0x08 +Inf, 0x10 -Inf, 0x20 denormal, 0x40 negative
// finite, 0x80 SNaN.
inline __mmask16 fpclass_ps_mask(__m512 a, int imm) {
  const I16 x = lanes(bits_as<__m512i>(a));
  unsigned k = 0;
  for (int l = 0; l < 16; ++l) {
    const uint32_t b = uint32_t(x.v[l]), e = (b >> 23) & 0xff, m = b & 0x7fffff;
    const bool nan = e == 0xff && m != 0;
    bool hit = ((imm & 0x01) && nan && (m & 0x400000)) || ((imm & 0x02) && b == 0) ||
               ((imm & 0x04) && b == 0x80000000u) || ((imm & 0x08) && b == 0x7f800000u) ||
               ((imm & 0x10) && b == 0xff800000u) || ((imm & 0x20) && e == 0 && m != 0) ||
               ((imm & 0x40) && (b >> 31) && e != 0xff && (b & 0x7fffffff) != 0) ||
               ((imm & 0x80) && nan && !(m & 0x400000));
    k |= unsigned(hit) << l;
  }
  return static_cast<__mmask16>(k);
}
// vcvtneps2bf16: round to nearest even; denormal inputs read as zero; a NaN is made quiet and
// keeps the top of its payload. Returned as the 16 words (vec.h casts the result to __m256i).
inline __m256i cvtneps_pbh(__m512 a) {
  const I16 x = lanes(bits_as<__m512i>(a));
  W16 r;
  for (int l = 0; l < 16; ++l) {
    uint32_t b = uint32_t(x.v[l]);
    if (((b >> 23) & 0xff) == 0xff && (b & 0x7fffff)) {
      r.v[l] = uint16_t((b >> 16) | 0x40);
      continue;
    }
    if (((b >> 23) & 0xff) == 0) b &= 0x80000000u;
    r.v[l] = uint16_t((b + 0x7fff + ((b >> 16) & 1)) >> 16);
  }
  return vec(r);
}

// vcvtne2ps2bf16: cvtneps_pbh of b in words 0-15, of a in words 16-31.
inline __m512i cvtne2ps_pbh(__m512 a, __m512 b) {
  const __m256i lo = cvtneps_pbh(b), hi = cvtneps_pbh(a);
  __m512i r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<char*>(&r) + 32, &hi, 32);
  return r;
}
// Word j of the result is f(word j of a, word j of b).
template <typename F>
inline __m512i wordwise(__m512i a, __m512i b, F f) {
  uint16_t x[32], y[32];
  std::memcpy(x, &a, 64);
  std::memcpy(y, &b, 64);
  for (int j = 0; j < 32; ++j) x[j] = f(x[j], y[j]);
  __m512i out;
  std::memcpy(&out, x, 64);
  return out;
}
inline __m512i add_epi16(__m512i a, __m512i b) {
  return wordwise(a, b, [](uint16_t x, uint16_t y) { return uint16_t(x + y); });
}
inline __m512i min_epu16(__m512i a, __m512i b) {
  return wordwise(a, b, [](uint16_t x, uint16_t y) { return y < x ? y : x; });
}
// vptestnmw: bit j set where word j of a AND word j of b is zero.
inline __mmask32 testn_epi16_mask(__m512i a, __m512i b) {
  uint16_t x[32], y[32];
  std::memcpy(x, &a, 64);
  std::memcpy(y, &b, 64);
  uint32_t k = 0;
  for (int j = 0; j < 32; ++j) k |= uint32_t((x[j] & y[j]) == 0) << j;
  return static_cast<__mmask32>(k);
}

} // namespace standin

// GCC defines some of these as macros when not optimising: replace those too.
#undef _mm512_setzero_ps
#undef _mm512_cmp_ps_mask
#undef _mm512_extractf32x8_ps
#undef _mm512_cvtps_ph
#undef _mm512_fpclass_ps_mask
#undef _mm512_set_epi32
#undef _mm512_castps_si512
#undef _mm512_castsi512_si256
#undef _mm512_add_epi32
#undef _mm512_srli_epi32
#undef _mm512_mask_mov_epi32
#undef _mm512_permutexvar_epi16
#undef _mm512_maskz_permutexvar_epi16
#undef _mm512_castsi256_si512
#undef _mm512_loadu_si512
#undef _mm512_permutexvar_ps
#undef _mm512_cvtne2ps_pbh
#undef _mm512_add_epi16
#undef _mm512_min_epu16
#undef _mm512_testn_epi16_mask
#define _mm512_setzero_ps standin::setzero_ps
#define _mm512_set1_ps standin::set1_ps
#define _mm512_set1_epi32 standin::set1_epi32
#define _mm512_loadu_ps standin::loadu_ps
#define _mm512_storeu_ps standin::storeu_ps
#define _mm512_maskz_loadu_ps standin::maskz_loadu_ps
#define _mm512_mask_storeu_ps standin::mask_storeu_ps
#define _mm512_mul_ps standin::mul_ps
#define _mm512_fmadd_ps standin::fmadd_ps
#define _mm512_and_si512 standin::and_si512
#define _mm512_and_ps standin::and_ps
#define _mm512_cmp_ps_mask standin::cmp_ps_mask
#define _mm512_mask_mov_ps standin::mask_mov_ps
#define _mm512_castps512_ps256 standin::castps512_ps256
#define _mm512_extractf32x8_ps standin::extractf32x8_ps
#define _mm512_cvtss_f32 standin::cvtss_f32
#define _mm512_castsi512_ps standin::castsi512_ps
#define _mm256_maskz_loadu_epi16 standin::maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 standin::mask_storeu_epi16
#define _mm256_permutexvar_epi16 standin::permutexvar_epi16
#define _mm512_cvtph_ps standin::cvtph_ps
#define _mm512_cvtps_ph standin::cvtps_ph
#define _mm512_fpclass_ps_mask standin::fpclass_ps_mask
#define _mm512_cvtneps_pbh standin::cvtneps_pbh
#define _mm512_set_epi32 standin::set_epi32
#define _mm512_castps_si512 standin::castps_si512
#define _mm512_castsi512_si256 standin::castsi512_si256
#define _mm512_add_epi32 standin::add_epi32
#define _mm512_srli_epi32 standin::srli_epi32
#define _mm512_mask_mov_epi32 standin::mask_mov_epi32
#define _mm512_permutexvar_epi16 standin::permutexvar_epi16_512
#define _mm512_maskz_permutexvar_epi16 standin::maskz_permutexvar_epi16
#define _mm512_permutex2var_epi16 standin::permutex2var_epi16
#define _mm512_storeu_si512 standin::storeu_si512
#define _mm512_castsi256_si512 standin::castsi256_si512
#define _mm512_loadu_si512 standin::loadu_si512
#define _mm512_permutexvar_ps standin::permutexvar_ps
#define _mm512_cvtne2ps_pbh standin::cvtne2ps_pbh
#define _mm512_add_epi16 standin::add_epi16
#define _mm512_min_epu16 standin::min_epu16
#define _mm512_testn_epi16_mask standin::testn_epi16_mask
