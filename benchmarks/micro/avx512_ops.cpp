// Cycles per instruction (reciprocal throughput) of the AVX-512 instructions the kernel's 16-bit
// paths are made of, on the machine it runs on: independent instructions in a loop, timed, over
// the time of one cycle read from a chain of dependent adds (one per cycle). Pairs show whether
// two kinds share a pipe (a pair costing the larger of its two does not). For reading a CPU, not
// for the kernel; see docs/cpu_kernel.md. Needs AVX-512 F/BW/VL and AVX512-BF16:
//
//   g++ -O2 -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -o /tmp/avx512_ops benchmarks/micro/avx512_ops.cpp && /tmp/avx512_ops
#include <cstdint>
#include <cstdio>

#include "micro.h"

namespace {

#define CLOBBERS                                                                                \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",      \
      "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", \
      "xmm21", "xmm22", "xmm23", "xmm24", "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", \
      "xmm31", "k2", "memory"
#define X8(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7)
// Eight independent instructions writing zmm0-7 from zmm30/31 (or, pairs, a second kind writing
// zmm10-17).
#define FMA(i) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define MUL(i) "vmulps %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define PERMW(i) "vpermw %%zmm30, %%zmm31, %%zmm" #i "%{%%k1%}%{z%}\n\t"
#define PERMT2W(i) "vpermt2w %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define SRL(i) "vpsrld $16, %%zmm30, %%zmm" #i "\n\t"
#define AND(i) "vpandd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define ADD(i) "vpaddd %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define CVT2BF(i) "vcvtne2ps2bf16 %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define CVTBF(i) "vcvtneps2bf16 %%zmm30, %%ymm" #i "\n\t"
#define PH2PS(i) "vcvtph2ps %%ymm30, %%zmm" #i "\n\t"
#define PS2PH(i) "vcvtps2ph $0, %%zmm30, %%ymm" #i "\n\t"
#define FMA_PERMW(i) FMA(i) "vpermw %%zmm30, %%zmm31, %%zmm1" #i "\n\t"
#define FMA_SRL(i) FMA(i) "vpsrld $16, %%zmm30, %%zmm1" #i "\n\t"
#define FMA_ADD(i) FMA(i) "vpaddd %%zmm30, %%zmm31, %%zmm1" #i "\n\t"
#define PERMW_SRL(i) "vpermw %%zmm30, %%zmm31, %%zmm" #i "\n\t" "vpsrld $16, %%zmm30, %%zmm1" #i "\n\t"
#define FMA_PH2PS(i) FMA(i) "vcvtph2ps %%ymm30, %%zmm1" #i "\n\t"
#define FMA_PS2PH(i) FMA(i) "vcvtps2ph $0, %%zmm30, %%ymm1" #i "\n\t"
#define PERMW_PH2PS(i) PERMW(i) "vcvtph2ps %%ymm30, %%zmm1" #i "\n\t"
#define PERMW_PS2PH(i) PERMW(i) "vcvtps2ph $0, %%zmm30, %%ymm1" #i "\n\t"
#define ADD_PH2PS(i) ADD(i) "vcvtph2ps %%ymm30, %%zmm1" #i "\n\t"
#define PERMW_ADD(i) PERMW(i) "vpaddd %%zmm30, %%zmm31, %%zmm1" #i "\n\t"
#define FMA_PERMW_ADD(i) FMA_PERMW(i) "vpaddd %%zmm30, %%zmm31, %%zmm2" #i "\n\t"
// The tests all write k2: k1 is the permutes' mask, and a test writing it would chain them.
#define TESTM(i) "vptestmd %%zmm30, %%zmm31, %%k2\n\t"
#define TERN(i) "vpternlogd $0xca, %%zmm30, %%zmm31, %%zmm" #i "\n\t"
#define BLENDM(i) "vpblendmd %%zmm30, %%zmm31, %%zmm" #i "%{%%k1%}\n\t"
#define ADDM(i) "vpaddd %%zmm30, %%zmm31, %%zmm" #i "%{%%k1%}\n\t"
#define FMA_TESTM(i) FMA(i) TESTM(i)
#define PERMW_TESTM(i) PERMW(i) TESTM(i)
#define FMA_TERN(i) FMA(i) "vpternlogd $0xca, %%zmm30, %%zmm31, %%zmm1" #i "\n\t"
#define PERMW_TERN(i) PERMW(i) "vpternlogd $0xca, %%zmm30, %%zmm31, %%zmm1" #i "\n\t"
#define PERMW_BLENDM(i) PERMW(i) "vpblendmd %%zmm30, %%zmm31, %%zmm1" #i "%{%%k1%}\n\t"
#define FMA_BLENDM(i) FMA(i) "vpblendmd %%zmm30, %%zmm31, %%zmm1" #i "%{%%k1%}\n\t"
#define ST64(i) "vmovups %%zmm" #i ", " #i "*64(%0)\n\t"
#define ST32(i) "vmovups %%ymm" #i ", " #i "*64(%0)\n\t"
#define LD64(i) "vmovups " #i "*64+4096(%0), %%zmm" #i "\n\t"
#define LD32(i) "vmovups " #i "*64+4096(%0), %%ymm" #i "\n\t"
#define ST64_ST32(i) ST64(i) "vmovups %%ymm1" #i ", " #i "*64+2048(%0)\n\t"

MICRO_LOOP(fma, X8(FMA))
MICRO_LOOP(mul, X8(MUL))
MICRO_LOOP(permw, X8(PERMW))
MICRO_LOOP(permt2w, X8(PERMT2W))
MICRO_LOOP(srl, X8(SRL))
MICRO_LOOP(and_, X8(AND))
MICRO_LOOP(add, X8(ADD))
MICRO_LOOP(cvt2bf, X8(CVT2BF))
MICRO_LOOP(cvtbf, X8(CVTBF))
MICRO_LOOP(ph2ps, X8(PH2PS))
MICRO_LOOP(ps2ph, X8(PS2PH))
MICRO_LOOP(fma_permw, X8(FMA_PERMW))
MICRO_LOOP(fma_srl, X8(FMA_SRL))
MICRO_LOOP(fma_add, X8(FMA_ADD))
MICRO_LOOP(permw_srl, X8(PERMW_SRL))
MICRO_LOOP(fma_ph2ps, X8(FMA_PH2PS))
MICRO_LOOP(fma_ps2ph, X8(FMA_PS2PH))
MICRO_LOOP(permw_ph2ps, X8(PERMW_PH2PS))
MICRO_LOOP(permw_ps2ph, X8(PERMW_PS2PH))
MICRO_LOOP(add_ph2ps, X8(ADD_PH2PS))
MICRO_LOOP(permw_add, X8(PERMW_ADD))
MICRO_LOOP(fma_permw_add, X8(FMA_PERMW_ADD))
MICRO_LOOP(testm, X8(TESTM))
MICRO_LOOP(tern, X8(TERN))
MICRO_LOOP(blendm, X8(BLENDM))
MICRO_LOOP(addm, X8(ADDM))
MICRO_LOOP(fma_testm, X8(FMA_TESTM))
MICRO_LOOP(permw_testm, X8(PERMW_TESTM))
MICRO_LOOP(fma_tern, X8(FMA_TERN))
MICRO_LOOP(permw_tern, X8(PERMW_TERN))
MICRO_LOOP(permw_blendm, X8(PERMW_BLENDM))
MICRO_LOOP(fma_blendm, X8(FMA_BLENDM))
MICRO_LOOP(st64, X8(ST64))
MICRO_LOOP(st32, X8(ST32))
MICRO_LOOP(ld64, X8(LD64))
MICRO_LOOP(ld32, X8(LD32))
MICRO_LOOP(st64_st32, X8(ST64_ST32))

} // namespace

int main() {
  const struct {
    const char* name;
    double (*f)(long);
  } kinds[] = {{"vfmadd231ps zmm", fma},
               {"vmulps zmm", mul},
               {"vpermw zmm {z}", permw},
               {"vpermt2w zmm", permt2w},
               {"vpsrld zmm", srl},
               {"vpandd zmm", and_},
               {"vpaddd zmm", add},
               {"vcvtne2ps2bf16 zmm", cvt2bf},
               {"vcvtneps2bf16 zmm->ymm", cvtbf},
               {"vcvtph2ps ymm->zmm", ph2ps},
               {"vcvtps2ph zmm->ymm", ps2ph},
               {"vfmadd + vpermw (pair)", fma_permw},
               {"vfmadd + vpsrld (pair)", fma_srl},
               {"vfmadd + vpaddd (pair)", fma_add},
               {"vpermw + vpsrld (pair)", permw_srl},
               {"vfmadd + vcvtph2ps (pair)", fma_ph2ps},
               {"vfmadd + vcvtps2ph (pair)", fma_ps2ph},
               {"vpermw + vcvtph2ps (pair)", permw_ph2ps},
               {"vpermw + vcvtps2ph (pair)", permw_ps2ph},
               {"vpaddd + vcvtph2ps (pair)", add_ph2ps},
               {"vpermw + vpaddd (pair)", permw_add},
               {"vfmadd + vpermw + vpaddd", fma_permw_add},
               {"vptestmd zmm -> k", testm},
               {"vpternlogd zmm", tern},
               {"vpblendmd zmm {k}", blendm},
               {"vpaddd zmm {k}", addm},
               {"vfmadd + vptestmd (pair)", fma_testm},
               {"vpermw + vptestmd (pair)", permw_testm},
               {"vfmadd + vpternlogd (pair)", fma_tern},
               {"vpermw + vpternlogd (pair)", permw_tern},
               {"vfmadd + vpblendmd (pair)", fma_blendm},
               {"vpermw + vpblendmd (pair)", permw_blendm},
               {"store zmm (L1)", st64},
               {"store ymm (L1)", st32},
               {"load zmm (L1)", ld64},
               {"load ymm (L1)", ld32},
               {"store zmm + store ymm (pair)", st64_st32}};
  asm volatile("kxnord %%k0, %%k0, %%k1" : : : "k1");
  // The time per instruction over the FMA's of the same round as well: where a neighbour slows
  // the chain of adds that reads the clock but not the vector pipes, the cycles are off and that
  // ratio is not.
  std::printf("cycles per instruction (or pair), best of 5 x 2M iterations of 8; its time over a "
              "vfmadd231ps's in the same round; the clock read around each line\n");
  for (int round = 0; round < 2; ++round) {
    double fma_ns = 0;
    for (const auto& k : kinds) {
      const micro::Best b = micro::best_of_five(k.f, 2000000);
      if (fma_ns == 0) fma_ns = b.ns;  // kinds[0] is the FMA
      std::printf("%-30s %6.2f  %5.2f x FMA  (%.2f GHz)\n", k.name, b.ns / b.cycle_ns / 8,
                  b.ns / fma_ns, 1 / b.cycle_ns);
    }
  }
}
