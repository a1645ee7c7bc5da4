// The AVX512-BF16 variant's fast bf16 narrowings against the integer round-to-nearest-even that
// every other path uses, over all 2^32 fp32 bit patterns:
// - one block (vec.h: narrow_bf16_finite, vcvtneps2bf16 behind an fpclass guard) against
//   narrow_bf16, canonical NaN included, 16 consecutive patterns per call;
// - two blocks (bf16_cvt_pair, vcvtne2ps2bf16, whose stores Bf16PairCheck checks) against
//   bf16_words_pair of the integer rounding (store_pair_exact's words), NaNs left out (the kernel
//   pairs only NaN-free blocks), 16 consecutive patterns in either block of a pair beside ones,
//   each pair with a check of its own: wherever a word differs, the check must ask for the exact
//   stores.
// Built and run by tests/test_cpu_kernel.py on CPUs with AVX512-BF16, with the variant's
// compiler flags.
// Exit status 0 and "0 mismatches" for each when the fast paths give the integer rounding's bits
// for every input.
#include "cpu/vec.h"

#include <cstdint>
#include <cstdio>

#if !defined(CPU_CAPABILITY_AVX512) || !defined(__AVX512BF16__)
#error "build with the avx512bf16 variant's flags (see setup.py)"
#endif

int main() {
  using namespace custom_ops::cpu::CPU_CAPABILITY;
  uint64_t mismatches = 0;
  auto compare = [&](__m512i bits, const char* what, uint64_t base) {
    const Blk b{_mm512_castsi512_ps(bits)};
    const __mmask16 differ = _mm256_cmpneq_epi16_mask(narrow_bf16_finite(b), narrow_bf16(b));
    if (differ != 0) {
      if (mismatches < 10) {
        std::printf("mismatch in %s 0x%08llx (lanes 0x%04x)\n", what,
                    static_cast<unsigned long long>(base), static_cast<unsigned>(differ));
      }
      mismatches += static_cast<uint64_t>(__builtin_popcount(differ));
    }
  };
  const __m512i step = _mm512_set1_epi32(16);
  __m512i bits = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (uint64_t base = 0; base < (uint64_t{1} << 32); base += 16) {
    compare(bits, "the block of fp32 bit patterns", base);
    bits = _mm512_add_epi32(bits, step);
  }
  // Zeros and infinities share their blocks above with denormals or NaNs (the integer path); here
  // they are alone in their blocks, so the vcvtneps2bf16 path converts them.
  const uint32_t alone[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x00800000u,
                            0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x3f808000u, 0x3f818000u};
  for (uint32_t a : alone) {
    for (uint32_t b : alone) {
      compare(_mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(static_cast<int>(a)),
                                      _mm512_set1_epi32(static_cast<int>(b))),
              "the pair", (uint64_t{a} << 32) | b);
    }
  }
  std::printf("%llu mismatches over 2^32 inputs\n", static_cast<unsigned long long>(mismatches));

  // Two blocks: each 16 consecutive patterns as block a beside a block b of ones, and as block b
  // beside ones, each pair through store_pair_finite with a check of its own (a check must find
  // a word in either half).
  using Io = StateIo<c10::BFloat16>;
  uint64_t unchecked = 0, caught = 0;
  alignas(64) c10::BFloat16 fast[32], exact[32];
  auto compare_pair = [&](const Blk& a, const Blk& b, uint64_t base) {
    Bf16PairCheck check;
    Io::store_pair_finite(fast, a, b, check);
    Io::store_pair_exact(exact, a, b);
    // Words to compare: not NaN (memory order: element 2i is lane i of its block, 2i + 1 lane
    // 8 + i).
    const __mmask16 nan_a = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
    const __mmask16 nan_b = _mm512_cmp_ps_mask(b.v, b.v, _CMP_UNORD_Q);
    uint32_t differ = 0;
    for (int e = 0; e < 32; ++e) {
      const int lane = (e % 16) / 2 + 8 * (e % 2);
      const bool nan = (((e < 16 ? nan_a : nan_b) >> lane) & 1u) != 0;
      if (!nan && fast[e].x != exact[e].x) differ |= 1u << e;
    }
    if (differ != 0 && !check.redo()) {
      if (unchecked < 10) {
        std::printf("unchecked mismatch in the pair of blocks at 0x%08llx (words 0x%08x)\n",
                    static_cast<unsigned long long>(base), differ);
      }
      unchecked += static_cast<uint64_t>(__builtin_popcount(differ));
    } else if (differ != 0) {
      caught += static_cast<uint64_t>(__builtin_popcount(differ));
    }
  };
  const Blk ones{_mm512_set1_ps(1.f)};
  bits = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (uint64_t base = 0; base < (uint64_t{1} << 32); base += 16) {
    const Blk x{_mm512_castsi512_ps(bits)};
    compare_pair(x, ones, base);
    compare_pair(ones, x, base);
    bits = _mm512_add_epi32(bits, step);
  }
  std::printf("%llu unchecked mismatches over 2 x 2^32 inputs in pairs (%llu caught by the check)\n",
              static_cast<unsigned long long>(unchecked), static_cast<unsigned long long>(caught));
  return mismatches == 0 && unchecked == 0 ? 0 : 1;
}
