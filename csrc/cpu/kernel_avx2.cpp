// AVX2 + FMA + F16C kernel (CPU_CAPABILITY=AVX2, -mavx2 -mfma -mf16c from setup.py); chosen at run
// time only on CPUs that have all three.
#include "cpu/kernel_impl.h"
