// AVX-512 kernel with AVX512-BF16 narrowing (CPU_CAPABILITY=AVX512BF16 with vec.h's AVX-512 code,
// -mavx512bf16 on top of the avx512 flags, from setup.py, built where the compiler has it);
// chosen at run time only on CPUs that have all of them. Same bits as the avx512 variant.
#include "cpu/kernel_impl.h"
