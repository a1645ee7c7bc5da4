// A labelled test double for the ATen threading symbols that at::parallel_for, compiled without
// OpenMP, calls from the kernel: one thread. It lets tests/cpp/portable_digest.cpp link the
// kernel for a CPU whose libtorch is not installed here (AArch64). Each task is computed by one
// thread from start to end, so the thread count changes no bits.
#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>

namespace at {
int get_thread_num() { return 0; }
namespace internal {
void set_thread_num(int) {}
} // namespace internal
} // namespace at

namespace c10 {
ParallelGuard::ParallelGuard(bool state) : previous_state_(state) {}
ParallelGuard::~ParallelGuard() = default;
} // namespace c10
