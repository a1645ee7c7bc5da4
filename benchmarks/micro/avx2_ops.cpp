// Cycles per instruction (reciprocal throughput) of the AVX2 and F16C instructions the avx2
// kernel's 16-bit paths are made of, on the machine it runs on: independent instructions in a
// loop, timed, over the time of one cycle read from a chain of dependent adds (one per cycle).
// Pairs show whether two kinds share a pipe (a pair costing the larger of its two does not).
// vmulps stands for the FMA pipes in the pairs: it has no loop-carried operand, where an FMA
// accumulates into its destination (its own line has twelve of them, enough for two pipes of
// latency 5 or less). For reading a CPU, not for the kernel; see docs/cpu_kernel.md. Needs AVX2,
// FMA and F16C:
//
//   g++ -O2 -mavx2 -mfma -mf16c -o /tmp/avx2_ops benchmarks/micro/avx2_ops.cpp && /tmp/avx2_ops
#include <cstdio>

#include "micro.h"

namespace {

#define CLOBBERS                                                                               \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",     \
      "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory"
// Six independent instructions writing ymm0-5 from ymm14/15 (in a pair, the second kind writes
// ymm8-13); FMAs accumulate into ymm0-11. Stores go to buf + 64 * register number.
#define X6(op) op(0) op(1) op(2) op(3) op(4) op(5)
#define X12(op) X6(op) op(6) op(7) op(8) op(9) op(10) op(11)
#define PAIR(A, B) A(0) B(8) A(1) B(9) A(2) B(10) A(3) B(11) A(4) B(12) A(5) B(13)
#define FMA(i) "vfmadd231ps %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define MUL(i) "vmulps %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define SLL(i) "vpslld $16, %%ymm14, %%ymm" #i "\n\t"
#define SRL(i) "vpsrld $16, %%ymm14, %%ymm" #i "\n\t"
#define SHUF(i) "vpshufb %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define AND(i) "vpand %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define ADD(i) "vpaddd %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define BLENDW(i) "vpblendw $0xaa, %%ymm14, %%ymm15, %%ymm" #i "\n\t"
#define PH2PS(i) "vcvtph2ps %%xmm14, %%ymm" #i "\n\t"
#define PS2PH(i) "vcvtps2ph $0, %%ymm14, %%xmm" #i "\n\t"
#define ST32(i) "vmovups %%ymm" #i ", " #i "*64(%0)\n\t"
#define ST16(i) "vmovups %%xmm" #i ", " #i "*64(%0)\n\t"
#define LD32(i) "vmovups " #i "*64+4096(%0), %%ymm" #i "\n\t"

MICRO_LOOP(fma, X12(FMA))
MICRO_LOOP(mul, X6(MUL))
MICRO_LOOP(sll, X6(SLL))
MICRO_LOOP(srl, X6(SRL))
MICRO_LOOP(shuf, X6(SHUF))
MICRO_LOOP(and_, X6(AND))
MICRO_LOOP(add, X6(ADD))
MICRO_LOOP(blendw, X6(BLENDW))
MICRO_LOOP(ph2ps, X6(PH2PS))
MICRO_LOOP(ps2ph, X6(PS2PH))
MICRO_LOOP(st32, X6(ST32))
MICRO_LOOP(st16, X6(ST16))
MICRO_LOOP(ld32, X6(LD32))
MICRO_LOOP(srl_mul, PAIR(SRL, MUL))
MICRO_LOOP(shuf_mul, PAIR(SHUF, MUL))
MICRO_LOOP(and_mul, PAIR(AND, MUL))
MICRO_LOOP(add_mul, PAIR(ADD, MUL))
MICRO_LOOP(blendw_mul, PAIR(BLENDW, MUL))
MICRO_LOOP(ph2ps_mul, PAIR(PH2PS, MUL))
MICRO_LOOP(ps2ph_mul, PAIR(PS2PH, MUL))
MICRO_LOOP(st32_mul, PAIR(ST32, MUL))
MICRO_LOOP(sll_srl, PAIR(SLL, SRL))
MICRO_LOOP(shuf_srl, PAIR(SHUF, SRL))
MICRO_LOOP(ph2ps_srl, PAIR(PH2PS, SRL))
MICRO_LOOP(ps2ph_srl, PAIR(PS2PH, SRL))
MICRO_LOOP(blendw_srl, PAIR(BLENDW, SRL))
MICRO_LOOP(add_srl, PAIR(ADD, SRL))
MICRO_LOOP(srl_st32, PAIR(SRL, ST32))
MICRO_LOOP(shuf_st32, PAIR(SHUF, ST32))
MICRO_LOOP(ph2ps_st32, PAIR(PH2PS, ST32))
MICRO_LOOP(ps2ph_st32, PAIR(PS2PH, ST32))
MICRO_LOOP(add_st32, PAIR(ADD, ST32))
MICRO_LOOP(ph2ps_shuf, PAIR(PH2PS, SHUF))
MICRO_LOOP(add_shuf, PAIR(ADD, SHUF))

} // namespace

int main() {
  const struct {
    const char* name;
    double (*f)(long);
    int per_iteration;  // instructions, or pairs
  } kinds[] = {{"vfmadd231ps ymm", fma, 12},
               {"vmulps ymm", mul, 6},
               {"vpslld ymm", sll, 6},
               {"vpsrld ymm", srl, 6},
               {"vpshufb ymm", shuf, 6},
               {"vpand ymm", and_, 6},
               {"vpaddd ymm", add, 6},
               {"vpblendw ymm", blendw, 6},
               {"vcvtph2ps xmm->ymm", ph2ps, 6},
               {"vcvtps2ph ymm->xmm", ps2ph, 6},
               {"store ymm (L1)", st32, 6},
               {"store xmm (L1)", st16, 6},
               {"load ymm (L1)", ld32, 6},
               {"vpsrld + vmulps (pair)", srl_mul, 6},
               {"vpshufb + vmulps (pair)", shuf_mul, 6},
               {"vpand + vmulps (pair)", and_mul, 6},
               {"vpaddd + vmulps (pair)", add_mul, 6},
               {"vpblendw + vmulps (pair)", blendw_mul, 6},
               {"vcvtph2ps + vmulps (pair)", ph2ps_mul, 6},
               {"vcvtps2ph + vmulps (pair)", ps2ph_mul, 6},
               {"store ymm + vmulps (pair)", st32_mul, 6},
               {"vpslld + vpsrld (pair)", sll_srl, 6},
               {"vpshufb + vpsrld (pair)", shuf_srl, 6},
               {"vcvtph2ps + vpsrld (pair)", ph2ps_srl, 6},
               {"vcvtps2ph + vpsrld (pair)", ps2ph_srl, 6},
               {"vpblendw + vpsrld (pair)", blendw_srl, 6},
               {"vpaddd + vpsrld (pair)", add_srl, 6},
               {"vpsrld + store ymm (pair)", srl_st32, 6},
               {"vpshufb + store ymm (pair)", shuf_st32, 6},
               {"vcvtph2ps + store ymm (pair)", ph2ps_st32, 6},
               {"vcvtps2ph + store ymm (pair)", ps2ph_st32, 6},
               {"vpaddd + store ymm (pair)", add_st32, 6},
               {"vcvtph2ps + vpshufb (pair)", ph2ps_shuf, 6},
               {"vpaddd + vpshufb (pair)", add_shuf, 6}};
  std::printf("cycles per instruction (or pair), best of 5 x 2M iterations; the clock read around "
              "each line\n");
  for (int round = 0; round < 2; ++round) {
    for (const auto& k : kinds) {
      const micro::Best b = micro::best_of_five(k.f, 2000000);
      std::printf("%-30s %6.2f  (%.2f GHz)\n", k.name, b.ns / b.cycle_ns / k.per_iteration,
                  1 / b.cycle_ns);
    }
  }
}
