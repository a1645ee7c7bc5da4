// The portable kernel's fused multiply-add without an FMA instruction (vec.h: fma_exact) against
// the hardware's, bit for bit: special values (zeros, denormals, infinities, NaN, the extremes)
// in every combination, sums built to land exactly halfway between two floats in double (where
// plain double rounding is wrong), cancellations, denormal results and random bit patterns.
// Built with the portable variant's flags by tests/test_cpu_kernel.py; the reference is compiled
// for FMA and runs only where the CPU has it (exit status 77 otherwise).
#include "cpu/vec.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

#if defined(__FP_FAST_FMAF)
#error "build without FMA instructions: this checks the emulation"
#endif

__attribute__((target("fma"))) static float fma_hw(float a, float b, float c) {
  return __builtin_fmaf(a, b, c);
}

static float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
static uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

int main() {
  using namespace custom_ops::cpu::CPU_CAPABILITY;
  if (!__builtin_cpu_supports("fma")) {
    std::printf("SKIP: this CPU has no FMA to compare with\n");
    return 77;
  }
  uint64_t checked = 0, mismatches = 0;
  auto compare = [&](float a, float b, float c, float want, float got, const char* which) {
    const bool same = std::isnan(want) ? std::isnan(got) : to_bits(want) == to_bits(got);
    if (!same) {
      if (mismatches < 10) {
        std::printf("fma(%a, %a, %a): hardware %a, %s %a\n", a, b, c, want, which, got);
      }
      ++mismatches;
    }
  };
  auto check = [&](float a, float b, float c) {
    const float want = fma_hw(a, b, c);
    ++checked;
    compare(a, b, c, want, fma_exact(a, b, c), "fma_exact");
#if defined(__SSE2__)
    // The SSE2 form the kernel's blocks use: lanes 0-1 and 2-3 take different paths.
    const __m128 r = fma_exact_ps(_mm_setr_ps(a, 1.f, 2.f, a), _mm_setr_ps(b, 1.f, 2.f, b),
                                  _mm_setr_ps(c, 0.f, 0.f, c));
    compare(a, b, c, want, _mm_cvtss_f32(r), "fma_exact_ps lane 0");
    compare(a, b, c, want, _mm_cvtss_f32(_mm_shuffle_ps(r, r, 3)), "fma_exact_ps lane 3");
#endif
  };
  const uint32_t special[] = {0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u, 0x007fffffu,
                              0x00800000u, 0x3f800000u, 0xbf800000u, 0x3f800001u, 0x3f7fffffu,
                              0x7f7fffffu, 0xff7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                              0x33800000u, 0x34000000u, 0x1f800000u, 0x5f800000u, 0x0c000000u};
  for (uint32_t a : special) {
    for (uint32_t b : special) {
      for (uint32_t c : special) {
        check(from_bits(a), from_bits(b), from_bits(c));
      }
    }
  }
  std::mt19937_64 rng(12345);
  for (int n = 0; n < 20000000; ++n) {
    const uint64_t r = rng();
    const float a = from_bits(static_cast<uint32_t>(r));
    const float b = from_bits(static_cast<uint32_t>(r >> 32));
    // c near -a*b (cancellation) or near a tie of a*b's rounding, or random.
    const uint64_t r2 = rng();
    float c;
    switch (r2 % 4) {
      case 0:
        c = from_bits(static_cast<uint32_t>(r2 >> 32));
        break;
      case 1:
        c = -a * b;
        break;
      case 2:
        c = std::ldexp(1.0f, std::ilogb(a * b) - 24 - static_cast<int>((r2 >> 8) % 8));
        break;
      default: {
        // Small values: products and sums in the float denormal range.
        const int e = -150 + static_cast<int>((r2 >> 40) % 40);
        const float x = std::ldexp(static_cast<float>((r2 >> 8) & 0xffffff), e);
        c = (r2 >> 63) ? -x : x;
      }
    }
    check(a, b, c);
    // Double rounding: a product of odd 12- and 13-bit integers with 25 significant bits lies
    // exactly halfway between two floats; a c far below the product's double ulp leaves the
    // double sum there, while the exact sum is off the tie, towards c.
    const int64_t m = static_cast<int64_t>(((r >> 3) & 0x7ff) | 0x801) *
                      static_cast<int64_t>(((r >> 20) & 0xfff) | 0x1001);
    if (m >= (int64_t{1} << 24)) {
      const int shift = static_cast<int>(r % 60) - 30;
      const float ah = std::ldexp(static_cast<float>(((r >> 3) & 0x7ff) | 0x801), shift) *
                       ((r >> 2) & 1 ? -1.0f : 1.0f);
      const float bh = static_cast<float>(((r >> 20) & 0xfff) | 0x1001);
      const float tiny = std::ldexp(1.0f, std::ilogb(static_cast<float>(m)) + shift - 56 -
                                              static_cast<int>((r >> 40) % 20));
      check(ah, bh, (r >> 63) ? -tiny : tiny);
    }
  }
  std::printf("%llu mismatches in %llu cases\n", static_cast<unsigned long long>(mismatches),
              static_cast<unsigned long long>(checked));
  return mismatches == 0 ? 0 : 1;
}
