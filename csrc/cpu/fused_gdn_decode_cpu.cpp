// CPU implementation of custom::npu_fused_gdn_decode and the run-time choice of kernel variant.
#include <atomic>
#include <cstdlib>

#include <ATen/ATen.h>
#include <ATen/Version.h>
#include <ATen/Dispatch.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include "cpu/kernel.h"
#include "fused_gdn_decode.h"

namespace custom_ops::cpu {
namespace {

bool cpu_supports(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  switch (isa) {
    case Isa::kPortable:
      return true;
    case Isa::kAvx2:
#ifdef CUSTOM_OPS_WITH_AVX2
      return avx2;
#else
      return false;
#endif
    case Isa::kAvx512:
#ifdef CUSTOM_OPS_WITH_AVX512
      return avx512;
#else
      return false;
#endif
    case Isa::kAvx512Bf16:
#ifdef CUSTOM_OPS_WITH_AVX512BF16
      return avx512 && __builtin_cpu_supports("avx512bf16");
#else
      return false;
#endif
  }
  return false;
#else
  return isa == Isa::kPortable;
#endif
}

constexpr Isa kAllIsas[] = {Isa::kPortable, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16};

// The best variant this build and CPU run that is not above `limit`.
Isa best_isa(Isa limit = Isa::kAvx512Bf16) {
  Isa best = Isa::kPortable;
  for (Isa isa : kAllIsas) {
    if (isa <= limit && cpu_supports(isa)) {
      best = isa;
    }
  }
  return best;
}

// The variant at load and for "auto": PyTorch's choice for its own CPU kernels
// (at::get_cpu_capability(), so ATEN_CPU_CAPABILITY=default|avx2|avx512 applies to this op as to
// ATen), capped by what this build and this CPU run. ATen's AVX512 means the best of the AVX-512
// variants. (ATen trusts ATEN_CPU_CAPABILITY even above what the CPU has; the cap does not.)
Isa default_isa() {
  const std::string capability = at::get_cpu_capability();
  Isa limit = Isa::kPortable;
  if (capability.find("AVX512") != std::string::npos) {
    limit = Isa::kAvx512Bf16;
  } else if (capability.find("AVX2") != std::string::npos) {
    limit = Isa::kAvx2;
  }
  return best_isa(limit);
}

bool parse_isa(const std::string& name, Isa* isa) {
  for (Isa candidate : kAllIsas) {
    if (name == isa_name(candidate)) {
      *isa = candidate;
      return true;
    }
  }
  return false;
}

// A name as it goes into an error message: quoted, with control characters and non-ASCII bytes
// escaped (a NUL would otherwise cut the message short).
std::string quoted(const std::string& name) {
  std::string out = "'";
  for (unsigned char c : name) {
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += static_cast<char>(c);
    } else {
      const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out + "'";
}

// custom_ops.cpu applies CUSTOM_OPS_CPU_ISA at import (loudly: see there), through set_isa.
std::atomic<Isa> g_isa{default_isa()};
std::atomic<bool> g_specialize_k{true};

// The profiler event of one CPU call (see npu_fused_gdn_decode_cpu).
const char* kernel_event_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2:
      return "custom_ops::npu_fused_gdn_decode_cpu.avx2";
    case Isa::kAvx512:
      return "custom_ops::npu_fused_gdn_decode_cpu.avx512";
    case Isa::kAvx512Bf16:
      return "custom_ops::npu_fused_gdn_decode_cpu.avx512bf16";
    default:
      return "custom_ops::npu_fused_gdn_decode_cpu.portable";
  }
}

} // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Bf16:
      return "avx512bf16";
    default:
      return "portable";
  }
}

Isa current_isa() {
  return g_isa.load(std::memory_order_relaxed);
}

std::vector<Isa> available_isas() {
  std::vector<Isa> isas;
  for (Isa isa : kAllIsas) {
    if (cpu_supports(isa)) {
      isas.push_back(isa);
    }
  }
  return isas;
}

bool set_isa(const std::string& name, std::string* error) {
  Isa isa;
  if (name == "auto") {
    isa = default_isa();
  } else if (!parse_isa(name, &isa)) {
    *error = "unknown CPU kernel variant " + quoted(name) +
             ", expected 'auto', 'portable', 'avx2', 'avx512' or 'avx512bf16'";
    return false;
  } else if (!cpu_supports(isa)) {
    std::string runnable;
    for (Isa ok : available_isas()) {
      runnable += std::string(runnable.empty() ? "" : ", ") + "'" + isa_name(ok) + "'";
    }
    *error = "CPU kernel variant " + quoted(name) +
             " is not available: this build or this CPU lacks it (available here: " + runnable +
             ")";
    return false;
  }
  g_isa = isa;
  return true;
}

bool set_k_specialization(bool enabled) {
  return g_specialize_k.exchange(enabled);
}

namespace {

// Runs the kernel of `isa` for input dtype T and state dtype S.
template <typename T, typename S>
void run_kernel(Isa isa, const GdnParams& p) {
  switch (isa) {
#ifdef CUSTOM_OPS_WITH_AVX512BF16
    case Isa::kAvx512Bf16:
      fused_gdn_decode_kernel_AVX512BF16<T, S>(p);
      return;
#endif
#ifdef CUSTOM_OPS_WITH_AVX512
    case Isa::kAvx512:
      fused_gdn_decode_kernel_AVX512<T, S>(p);
      return;
#endif
#ifdef CUSTOM_OPS_WITH_AVX2
    case Isa::kAvx2:
      fused_gdn_decode_kernel_AVX2<T, S>(p);
      return;
#endif
    default:
      fused_gdn_decode_kernel_DEFAULT<T, S>(p);
  }
}

} // namespace

namespace {

// Both overloads: `out` is null for the default one (allocated here after the checks).
at::Tensor run_op(
    const at::Tensor& mixed_qkv,
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& a_log,
    const at::Tensor& dt_bias,
    at::Tensor& state_ref,
    const at::Tensor& ssm_state_indices,
    double scale,
    double softplus_threshold,
    const at::Tensor* out_arg) {
  const Isa isa = current_isa();
  // Under torch.profiler: a child of the dispatcher's custom::npu_fused_gdn_decode event that
  // names the backend and the kernel variant that ran.
  RECORD_FUNCTION(kernel_event_name(isa), c10::ArrayRef<const c10::IValue>{});
  const GdnDims d = check_fused_gdn_decode_inputs(
      mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale, softplus_threshold);
  const int64_t B = d.batch.expect_int(), Hv = d.num_v_heads.expect_int();
  const int64_t V = d.head_v.expect_int();
  // The indices are read once: the slot check and the kernel both use this snapshot, so a write
  // to ssm_state_indices during the call (another thread; or this call's own state update when
  // the indices live inside state_ref) cannot hand the kernel a slot the check never saw.
  if (out_arg != nullptr) {
    check_fused_gdn_decode_out(*out_arg, d, mixed_qkv, state_ref);
  }
  const SlotSnapshot slots(ssm_state_indices);
  check_slot_indices(slots.data(), B, d.block_num.expect_int());

  at::Tensor out = out_arg != nullptr ? *out_arg : at::empty({B, 1, Hv, V}, mixed_qkv.options());
  GdnParams p;
  p.batch = B;
  p.num_heads = d.num_heads.expect_int();
  p.num_v_heads = Hv;
  p.head_k = d.head_k.expect_int();
  p.head_v = V;
  p.mixed_qkv = mixed_qkv.const_data_ptr();
  p.qkv_stride_row = mixed_qkv.stride(0);
  p.qkv_stride_col = mixed_qkv.stride(1);
  p.a = a.const_data_ptr();
  p.a_stride_row = a.stride(0);
  p.a_stride_col = a.stride(1);
  p.b = b.const_data_ptr();
  p.b_stride_row = b.stride(0);
  p.b_stride_col = b.stride(1);
  p.a_log = a_log.const_data_ptr<float>();
  p.a_log_stride = a_log.stride(0);
  p.dt_bias = dt_bias.const_data_ptr();
  p.dt_bias_stride = dt_bias.stride(0);
  p.state = state_ref.data_ptr();
  p.state_stride_slot = state_ref.stride(0);
  p.indices = slots.data();
  p.out = out.data_ptr();
  p.scale = static_cast<float>(scale);
  p.softplus_threshold = static_cast<float>(softplus_threshold);
  p.specialize_k = g_specialize_k.load(std::memory_order_relaxed);
  TORCH_INTERNAL_ASSERT(p.num_heads > 0 && p.num_v_heads % p.num_heads == 0 && p.head_k > 0 &&
                        p.head_v > 0);  // the check's guarantees; the kernel divides by them
  // Input bf16/fp16 (TypeError from the check otherwise); state fp32 or the input dtype.
  AT_DISPATCH_REDUCED_FLOATING_TYPES(mixed_qkv.scalar_type(), "npu_fused_gdn_decode", [&] {
    if (state_ref.scalar_type() == at::kFloat) {
      run_kernel<scalar_t, float>(isa, p);
    } else {
      TORCH_INTERNAL_ASSERT(state_ref.scalar_type() == mixed_qkv.scalar_type());
      run_kernel<scalar_t, scalar_t>(isa, p);
    }
  });
  return out;
}

} // namespace

at::Tensor npu_fused_gdn_decode_cpu(
    const at::Tensor& mixed_qkv,
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& a_log,
    const at::Tensor& dt_bias,
    at::Tensor& state_ref,
    const at::Tensor& ssm_state_indices,
    double scale,
    double softplus_threshold) {
  return run_op(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
                softplus_threshold, nullptr);
}

at::Tensor& npu_fused_gdn_decode_out_cpu(
    const at::Tensor& mixed_qkv,
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& a_log,
    const at::Tensor& dt_bias,
    at::Tensor& state_ref,
    const at::Tensor& ssm_state_indices,
    double scale,
    double softplus_threshold,
    at::Tensor& out) {
  run_op(mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
         softplus_threshold, &out);
  return out;
}

} // namespace custom_ops::cpu

TORCH_LIBRARY_IMPL(custom, CPU, m) {
  m.impl("npu_fused_gdn_decode", &custom_ops::cpu::npu_fused_gdn_decode_cpu);
  m.impl("npu_fused_gdn_decode.out", &custom_ops::cpu::npu_fused_gdn_decode_out_cpu);
}
