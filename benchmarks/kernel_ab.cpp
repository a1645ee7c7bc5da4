// The driver of benchmarks/kernel_ab.py: several builds of the CPU kernel body (kernel_impl.h from
// different source trees, each compiled under its own CPU_CAPABILITY name AB0, AB1, ..) called on
// the same inputs, first for their bits (out and state must equal AB0's), then timed interleaved:
// every repetition calls each build once and an in-place read-modify-write of the same bytes, in
// an order in which each of them follows every other equally often, so the machine's drift and
// what one call leaves the next hit them alike. Prints one line per
// (state dtype, B, threads): medians in us, and each build's % of the rmw time, and the core's
// clock read before and after the line.
//
// Usage: kernel_ab MODE STATES THREADS BATCHES REPS POOL_BYTES CHECK
//   MODE     dram: fresh slots of a pool of POOL_BYTES every call (the serving case);
//            cache: the same B slots every call;
//            l1: one value head of 128 and 512 rows (B = 1, H = Hv = 1, in L1/L2 on 1 thread):
//                prints ns per row from the difference, the per-call costs cancelled;
//            l1only: the same from 8 and 40 rows, the state in L1
//   STATES   comma-separated of fp32, bf16, fp16 (inputs bf16; fp16 for an fp16 state)
//   THREADS, BATCHES  comma-separated lists
//   CHECK    1: stop (exit status 1) when a build's bits differ from AB0's; 0: say so and time it
//            anyway (what-if experiments that drop work on purpose)
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core_clock.h"
#include "cpu/kernel.h"

// kernel_ab_builds.inc: AB_BUILD(n) for each build, written by kernel_ab.py.
namespace custom_ops::cpu {
#define AB_BUILD(N)                      \
  template <typename T, typename S>      \
  void fused_gdn_decode_kernel_AB##N(const GdnParams&);
#include "kernel_ab_builds.inc"
#undef AB_BUILD
}  // namespace custom_ops::cpu

namespace {
using custom_ops::cpu::GdnParams;
using Clock = std::chrono::steady_clock;

// Read at run time, so the rmw loop cannot be folded away.
volatile uint32_t g_zero = 0;
// Whether differing bits stop a line (CHECK).
bool g_check = true;

template <typename T, typename S>
std::vector<void (*)(const GdnParams&)> builds() {
  std::vector<void (*)(const GdnParams&)> v;
#define AB_BUILD(N) v.push_back(&custom_ops::cpu::fused_gdn_decode_kernel_AB##N<T, S>);
#include "kernel_ab_builds.inc"
#undef AB_BUILD
  return v;
}

std::vector<int> int_list(const char* s) {
  std::vector<int> v;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) v.push_back(std::stoi(item));
  return v;
}

struct Shape {
  int B, H, Hv, K, V;
};

// Memory aligned as PyTorch's CPU allocator aligns a tensor (64 bytes). std::allocator's large
// blocks start 16 bytes past a page (glibc), which put every state row across cache lines.
template <typename X>
struct Aligned64 {
  using value_type = X;
  Aligned64() = default;
  template <typename Y>
  Aligned64(const Aligned64<Y>&) {}
  X* allocate(size_t n) {
    void* p = nullptr;
    if (posix_memalign(&p, 64, n * sizeof(X)) != 0) throw std::bad_alloc();
    return static_cast<X*>(p);
  }
  void deallocate(X* p, size_t) { std::free(p); }
  template <typename Y>
  bool operator==(const Aligned64<Y>&) const {
    return true;
  }
};
template <typename X>
using AlignedVector = std::vector<X, Aligned64<X>>;

// One problem: inputs, a pool and a slot rotation; time(k) calls build k on the next B slots.
template <typename T, typename S>
class Problem {
 public:
  Problem(const Shape& sh, bool fresh_slots, size_t pool_bytes)
      : sh_(sh), fresh_(fresh_slots), ks_(builds<T, S>()) {
    const int W = 2 * sh.H * sh.K + sh.Hv * sh.V;
    slot_ = size_t(sh.Hv) * sh.V * sh.K;
    slots_ = fresh_slots ? std::max<size_t>(pool_bytes / (slot_ * sizeof(S)), 2 * sh.B) + 1
                         : size_t(sh.B) + 1;
    // Random values in slot 0, copied to the others (a pool of many slots fills quickly).
    state_.resize(slots_ * slot_);
    std::mt19937 gen(1);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (size_t e = 0; e < slot_; ++e) state_[e] = S(0.1f * normal(gen));
    for (size_t n = 1; n < slots_; ++n) {
      std::memcpy(state_.data() + n * slot_, state_.data(), slot_ * sizeof(S));
    }
    qkv_.resize(size_t(sh.B) * W);
    a_.resize(sh.B * sh.Hv);
    b_.resize(sh.B * sh.Hv);
    dt_bias_.resize(sh.Hv);
    for (auto* v : {&qkv_, &a_, &b_, &dt_bias_}) {
      for (auto& x : *v) x = T(normal(gen));
    }
    a_log_.assign(sh.Hv, 0.5f);
    out_.resize(size_t(sh.B) * sh.Hv * sh.V);
    order_.resize(slots_ - 1);
    for (size_t i = 0; i < order_.size(); ++i) order_[i] = int32_t(i + 1);
    std::shuffle(order_.begin(), order_.end(), gen);
    idx_.resize(sh.B);
    p_ = GdnParams{};
    p_.batch = sh.B;
    p_.num_heads = sh.H;
    p_.num_v_heads = sh.Hv;
    p_.head_k = sh.K;
    p_.head_v = sh.V;
    p_.mixed_qkv = qkv_.data();
    p_.qkv_stride_row = W;
    p_.qkv_stride_col = 1;
    p_.a = a_.data();
    p_.a_stride_row = sh.Hv;
    p_.a_stride_col = 1;
    p_.b = b_.data();
    p_.b_stride_row = sh.Hv;
    p_.b_stride_col = 1;
    p_.a_log = a_log_.data();
    p_.a_log_stride = 1;
    p_.dt_bias = dt_bias_.data();
    p_.dt_bias_stride = 1;
    p_.state = state_.data();
    p_.state_stride_slot = int64_t(slot_);
    p_.indices = idx_.data();
    p_.out = out_.data();
    p_.scale = 1.f / std::sqrt(float(sh.K));
    p_.softplus_threshold = 20.f;
    p_.specialize_k = true;
  }

  size_t builds_count() const { return ks_.size(); }

  // How far b is from a: how many elements differ and the largest difference relative to
  // a's largest magnitude (a NaN in either counts as a difference of 1).
  template <typename U>
  static std::string distance(const char* what, const std::vector<U>& a, const std::vector<U>& b) {
    size_t n = 0;
    double scale = 0, worst = 0;
    for (size_t e = 0; e < a.size(); ++e) scale = std::max(scale, std::fabs(double(float(a[e]))));
    for (size_t e = 0; e < a.size(); ++e) {
      if (std::memcmp(&a[e], &b[e], sizeof(U)) == 0) continue;
      ++n;
      const double x = float(a[e]), y = float(b[e]);
      const double d = std::isnan(x) || std::isnan(y) ? 1.0 : std::fabs(x - y) / scale;
      worst = std::max(worst, d);
    }
    char buf[160];
    std::snprintf(buf, sizeof(buf), "%s %zu of %zu elements, largest difference %.2e of max |%s|",
                  what, n, a.size(), worst, what);
    return buf;
  }

  // Whether every build gives AB0's out and state (three steps from the same B slots).
  bool same_bits() {
    next_slots();
    const std::vector<S> start = slots();
    std::vector<S> first_state;
    std::vector<T> first_out;
    bool same = true;
    for (size_t k = 0; k < ks_.size(); ++k) {
      set_slots(start);
      for (int step = 0; step < 3; ++step) ks_[k](p_);
      const std::vector<S> state = slots();
      const std::vector<T> out(out_.begin(), out_.end());
      if (k == 0) {
        first_state = state;
        first_out = out;
      } else if (std::memcmp(first_state.data(), state.data(), state.size() * sizeof(S)) ||
                 std::memcmp(first_out.data(), out.data(), out.size() * sizeof(T))) {
        std::printf("build %zu: bits differ from build 0%s: %s; %s\n", k,
                    g_check ? "" : " (timed anyway)", distance("state", first_state, state).c_str(),
                    distance("out", first_out, out).c_str());
        if (g_check) same = false;
      }
    }
    set_slots(start);
    return same;
  }

  // Seconds of one call of build k (k == builds_count(): the rmw), on the next B slots; the
  // mean of `calls` calls one after another (on the same slots), for calls shorter than the
  // clock's steps (10 ns on a KVM guest's TSC).
  double time(size_t k, int calls = 1) {
    next_slots();
    const auto t0 = Clock::now();
    for (int c = 0; c < calls; ++c) {
      if (k < ks_.size()) {
        ks_[k](p_);
      } else {
        rmw();
      }
    }
    return std::chrono::duration<double>(Clock::now() - t0).count() / calls;
  }

 private:
  // The state of the current B slots, and back.
  std::vector<S> slots() const {
    std::vector<S> v(sh_.B * slot_);
    for (int i = 0; i < sh_.B; ++i) {
      std::memcpy(v.data() + i * slot_, state_.data() + idx_[i] * slot_, slot_ * sizeof(S));
    }
    return v;
  }
  void set_slots(const std::vector<S>& v) {
    for (int i = 0; i < sh_.B; ++i) {
      std::memcpy(state_.data() + idx_[i] * slot_, v.data() + i * slot_, slot_ * sizeof(S));
    }
  }

  void next_slots() {
    for (int i = 0; i < sh_.B; ++i) {
      idx_[i] = fresh_ ? order_[cursor_++ % order_.size()] : i + 1;
    }
  }

  // x |= 0 over the B slots' state, split over the threads by value head as the kernel splits it.
  void rmw() {
    const uint32_t zero = g_zero;
    const size_t words = slot_ * sizeof(S) / 4 / sh_.Hv;
    at::parallel_for(0, int64_t(sh_.B) * sh_.Hv, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        uint32_t* w = reinterpret_cast<uint32_t*>(state_.data() + idx_[t / sh_.Hv] * slot_) +
                      (t % sh_.Hv) * words;
        for (size_t e = 0; e < words; ++e) w[e] |= zero;
      }
    });
  }

  Shape sh_;
  bool fresh_;
  std::vector<void (*)(const GdnParams&)> ks_;
  size_t slot_ = 0, slots_ = 0, cursor_ = 0;
  AlignedVector<S> state_;
  AlignedVector<T> qkv_, a_, b_, dt_bias_, out_;
  std::vector<float> a_log_;
  std::vector<int32_t> order_, idx_;
  GdnParams p_;
};

// The order of calls: a cycle through items 0 .. n-1 (n >= 2) in which every item follows every
// other exactly once (n - 1 appearances of each): an Euler circuit of the complete directed graph,
// by Hierholzer's algorithm. A call pays for what the call before it left (dirty lines still to
// write back, the prefetchers' state): with the order rotated one place every repetition, each
// build followed the same one four times in five, and on AMD Zen 2 the build after the rmw took
// 10-24 % longer than its copies from DRAM (docs/bench_ab_zen2_order.txt).
std::vector<size_t> each_follows_each_once(size_t n) {
  std::vector<std::vector<size_t>> next(n);
  for (size_t u = 0; u < n; ++u) {
    for (size_t v = n; v-- > 0;) {
      if (v != u) next[u].push_back(v);
    }
  }
  std::vector<size_t> path{0}, circuit;
  while (!path.empty()) {
    const size_t u = path.back();
    if (next[u].empty()) {
      circuit.push_back(u);
      path.pop_back();
    } else {
      path.push_back(next[u].back());
      next[u].pop_back();
    }
  }
  std::reverse(circuit.begin(), circuit.end());
  circuit.pop_back();  // the circuit ends where it began
  // What the timing relies on, checked: each ordered pair of neighbours (cyclically) once.
  std::vector<int> seen(n * n, 0);
  for (size_t i = 0; i < circuit.size(); ++i) {
    ++seen[circuit[i] * n + circuit[(i + 1) % circuit.size()]];
  }
  for (size_t u = 0; u < n; ++u) {
    for (size_t v = 0; v < n; ++v) {
      if (seen[u * n + v] != (u != v ? 1 : 0)) {
        std::fprintf(stderr, "kernel_ab: call order of %zu items: %zu after %zu %d times\n", n,
                     v, u, seen[u * n + v]);
        std::exit(3);
      }
    }
  }
  return circuit;
}

// Median seconds per build and call (rmw last), each of at least `reps` samples timing `calls`
// calls, after one warm-up call of each. The calls follow each_follows_each_once's cycle, whole
// cycles only, so every build and the rmw follow each of the others equally often.
template <typename T, typename S>
std::vector<double> medians(Problem<T, S>& problem, int reps, int calls = 1) {
  const size_t n = problem.builds_count() + 1;
  const std::vector<size_t> cycle = each_follows_each_once(n);
  std::vector<std::vector<double>> t(n);
  for (size_t k = 0; k < n; ++k) problem.time(k, calls);
  const size_t cycles = (size_t(reps) + n - 2) / (n - 1);
  for (size_t c = 0; c < cycles; ++c) {
    for (size_t k : cycle) t[k].push_back(problem.time(k, calls));
  }
  std::vector<double> m;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    m.push_back(v[v.size() / 2]);
  }
  return m;
}

// " | clock A-B GHz": the clock read before and after a line (nothing where it cannot be read).
std::string clock_note(double before, double after) {
  if (before <= 0) return "";
  char buf[48];
  std::snprintf(buf, sizeof(buf), "  | clock %.2f-%.2f GHz", before, after);
  return buf;
}

template <typename T, typename S>
bool report(const char* name, const char* mode, const std::vector<int>& threads,
            const std::vector<int>& batches, int reps, size_t pool_bytes) {
  const bool l1 = !std::strcmp(mode, "l1"), l1only = !std::strcmp(mode, "l1only");
  if (l1 || l1only) {
    // One value head of a small and a large row count, timed alone: 128 and 512 rows (the larger
    // in L2 for every state dtype), or 8 and 40 (at most 20 KiB of state: in L1 with the
    // kernel's vectors and ring). The difference is ns per row without the per-call costs.
    const int lo = l1 ? 128 : 8, hi = l1 ? 512 : 40, samples = l1 ? 20 : 25, calls = l1 ? 1 : 8;
    at::set_num_threads(1);
    Problem<T, S> small({1, 1, 1, 128, lo}, false, 0), large({1, 1, 1, 128, hi}, false, 0);
    if (!small.same_bits() || !large.same_bits()) return false;
    const double ghz = custom_ops::core_clock_ghz();
    const auto a = medians(small, reps * samples * 2, calls);
    const auto b = medians(large, reps * samples, calls);
    const double rows = hi - lo;
    std::printf("%-5s %-5s 1 thread, ns per row:", name, mode);
    for (size_t k = 0; k + 1 < a.size(); ++k) {
      std::printf("  AB%zu %6.2f", k, (b[k] - a[k]) / rows * 1e9);
    }
    std::printf("  | rmw %6.2f%s\n", (b.back() - a.back()) / rows * 1e9,
                clock_note(ghz, custom_ops::core_clock_ghz()).c_str());
    return true;
  }
  const bool fresh = !std::strcmp(mode, "dram");
  for (int th : threads) {
    for (int B : batches) {
      at::set_num_threads(th);
      Problem<T, S> problem({B, 16, 32, 128, 128}, fresh, pool_bytes);
      if (!problem.same_bits()) return false;
      const double ghz = custom_ops::core_clock_ghz();
      const auto m = medians(problem, reps);
      std::printf("%-5s %-5s B=%-3d threads=%d  rmw %8.1f us |", name, mode, B, th, m.back() * 1e6);
      for (size_t k = 0; k + 1 < m.size(); ++k) {
        std::printf("  AB%zu %8.1f us %5.1f%%", k, m[k] * 1e6, 100 * m.back() / m[k]);
      }
      std::printf("%s\n", clock_note(ghz, custom_ops::core_clock_ghz()).c_str());
      std::fflush(stdout);
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s MODE STATES THREADS BATCHES REPS POOL_BYTES CHECK\n",
                 argv[0]);
    return 2;
  }
  const char* mode = argv[1];
  const std::string states = argv[2];
  const auto threads = int_list(argv[3]), batches = int_list(argv[4]);
  const int reps = std::atoi(argv[5]);
  const size_t pool = std::strtoull(argv[6], nullptr, 10);
  g_check = std::atoi(argv[7]) != 0;
  bool ok = true;
  std::stringstream in(states);
  for (std::string s; std::getline(in, s, ',');) {
    if (s == "fp32") {
      ok = report<c10::BFloat16, float>("fp32", mode, threads, batches, reps, pool) && ok;
    } else if (s == "bf16") {
      ok = report<c10::BFloat16, c10::BFloat16>("bf16", mode, threads, batches, reps, pool) && ok;
    } else if (s == "fp16") {
      ok = report<c10::Half, c10::Half>("fp16", mode, threads, batches, reps, pool) && ok;
    } else {
      std::fprintf(stderr, "unknown state dtype %s\n", s.c_str());
      return 2;
    }
  }
  return ok ? 0 : 1;
}
