// The core's clock, read by the benchmarks (custom_ops_internal.core_clock_ghz for
// `python -m benchmarks`, benchmarks/kernel_ab.cpp and benchmarks/micro) next to what they time.
#pragma once

#include <algorithm>
#include <chrono>

namespace custom_ops {

// The core's clock in GHz, from a chain of dependent adds (one a cycle on x86-64 cores); 0
// elsewhere. A shared VM's cores slow by half for minutes at a time while memory does not, which
// lowers every ratio to rmw, the more so the more compute a state dtype costs, and a neighbour on
// the same core looks the same to it: read before and after what is timed, so that a slow spell
// shows where it fell. The best of five readings of about 20 ms (at 2.5 GHz): a core waking from
// idle takes a few ms to clock up.
inline double core_clock_ghz() {
#if defined(__x86_64__)
  using Clock = std::chrono::steady_clock;
  constexpr long kAdds = 50000000;
  double best = 0;
  for (int reading = 0; reading < 5; ++reading) {
    long x = 0;
    const auto t0 = Clock::now();
    for (long i = 0; i < kAdds; ++i) {
      asm volatile("add $1, %0" : "+r"(x));
    }
    best = std::max(best, kAdds / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9);
  }
  return best;
#else
  return 0;
#endif
}

} // namespace custom_ops
