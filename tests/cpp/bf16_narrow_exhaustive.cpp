// The AVX512-BF16 variant's fast bf16 narrowing (vec.h: narrow_bf16_finite, vcvtneps2bf16 behind
// an fpclass guard) against the integer round-to-nearest-even that every other path uses
// (narrow_bf16, canonical NaN included), over all 2^32 fp32 bit patterns, 16 consecutive ones per
// call. Built and run by tests/test_cpu_kernel.py on CPUs with AVX512-BF16, with the variant's
// compiler flags.
// Exit status 0 and "0 mismatches" when the two give the same bits for every input.
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
  return mismatches == 0 ? 0 : 1;
}
