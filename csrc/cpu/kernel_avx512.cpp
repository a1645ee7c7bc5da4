// AVX-512 kernel (CPU_CAPABILITY=AVX512, -mavx512f/bw/vl/dq -mfma from setup.py, as ATen builds
// its AVX512 variant); chosen at run time only on CPUs that have all of them.
#include "cpu/kernel_impl.h"
