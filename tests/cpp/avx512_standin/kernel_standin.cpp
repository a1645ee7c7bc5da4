// The kernel body as the avx512 (or, with -D__AVX512BF16__, avx512bf16) variant compiles it, on
// the AVX-512 stand-ins of standin.h. Built by tests/test_cpu_kernel.py with the AVX2 flags.
#include "standin.h"

#include "cpu/kernel_impl.h"
