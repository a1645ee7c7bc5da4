// The AVX-512 kernel's bf16 block operations on plain vectors, in the pair order (element 2i of a
// block of 16 in lane i, element 2i + 1 in lane 8 + i): widening, rounding and the paired
// narrowing. vec.h wraps them for the kernel; benchmarks/micro times them. Free of torch's
// headers for the latter; internal linkage, so every variant's translation unit, compiled with
// its own instruction-set flags, keeps its own copy.
#pragma once

#include <immintrin.h>

namespace custom_ops::cpu::bf16_avx512 {
namespace {

// 16 bf16 in pair order by one word permute of the 16 loaded words: word 2l + 1 of the result
// (lane l's high half) takes the element of lane l, the even words (the low halves) are zeroed by
// the mask.
inline __m512 widen(__m256i w) {
  const __m512i order = _mm512_set_epi32(15 << 16, 13 << 16, 11 << 16, 9 << 16, 7 << 16, 5 << 16,
                                         3 << 16, 1 << 16, 14 << 16, 12 << 16, 10 << 16, 8 << 16,
                                         6 << 16, 4 << 16, 2 << 16, 0);
  return _mm512_castsi512_ps(
      _mm512_maskz_permutexvar_epi16(0xaaaaaaaau, order, _mm512_castsi256_si512(w)));
}

// bf16 rounding in integers, the result in the HIGH 16 bits of each 32-bit lane: bits + 0x7fff
// + (bit 16 of bits), which carries into the high half when the low half is over 0x8000, or is
// 0x8000 (a tie) from an odd value. Right for every x but NaN.
inline __m512i round_high_no_nan(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
}

// The rounded high words of two blocks (a: elements [0, 16), b: [16, 32)) picked into memory
// order by one two-source word permute, for one 64-byte store.
inline __m512i words_pair(__m512i a_high, __m512i b_high) {
  // Word 2i <- word 2i + 1 (lane i), word 2i + 1 <- word 17 + 2i (lane 8 + i); b's words are
  // words 32-63 of the two sources.
  const __m512i order = _mm512_set_epi32(
      (63 << 16) | 47, (61 << 16) | 45, (59 << 16) | 43, (57 << 16) | 41, (55 << 16) | 39,
      (53 << 16) | 37, (51 << 16) | 35, (49 << 16) | 33, (31 << 16) | 15, (29 << 16) | 13,
      (27 << 16) | 11, (25 << 16) | 9, (23 << 16) | 7, (21 << 16) | 5, (19 << 16) | 3,
      (17 << 16) | 1);
  return _mm512_permutex2var_epi16(a_high, order, b_high);
}

}  // namespace
}  // namespace custom_ops::cpu::bf16_avx512
