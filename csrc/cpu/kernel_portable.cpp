// Portable kernel: built with the compiler's baseline instruction set (CPU_CAPABILITY=DEFAULT).
#include "cpu/kernel_impl.h"
