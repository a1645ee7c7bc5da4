// CPU implementation of custom::npu_fused_gdn_decode and the run-time choice of kernel variant.
#include <algorithm>
#include <atomic>
#include <string>
#include <string_view>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu/kernel.h"
#include "fused_gdn_decode.h"

namespace custom_ops::cpu {

namespace {
#if defined(__x86_64__) || defined(__i386__)
// What cpu_has reads: CPUID, and XGETBV for which registers the OS saves.
struct X86Features {
  bool avx = false;     // the CPU has AVX and the OS saves the ymm registers
  bool avx512 = false;  // and also the opmask and zmm registers
  unsigned leaf1_ecx = 0, leaf7_ebx = 0, leaf7_1_eax = 0;

  X86Features() {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) {
      return;
    }
    leaf1_ecx = c;
    if ((c & bit_OSXSAVE) != 0) {
      unsigned lo, hi;
      __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));  // XCR0, without needing -mxsave
      avx = (c & bit_AVX) != 0 && (lo & 0x6) == 0x6;
      avx512 = avx && (lo & 0xe0) == 0xe0;
    }
    if (__get_cpuid_max(0, nullptr) >= 7) {
      __cpuid_count(7, 0, a, b, c, d);
      leaf7_ebx = b;
      if (a >= 1) {  // the highest sub-leaf of leaf 7
        __cpuid_count(7, 1, a, b, c, d);
        leaf7_1_eax = a;
      }
    }
  }
};
#endif
} // namespace

// By the rules of GCC's __builtin_cpu_supports (an AVX or AVX-512 feature counts only where the
// OS saves the registers it needs), but not by that builtin: clang 14's rejects "f16c" at compile
// time.
bool cpu_has(std::string_view feature) {
  enum Reg { kLeaf1Ecx, kLeaf7Ebx, kLeaf7_1Eax };
  struct Known {
    std::string_view name;
    Reg reg;
    int bit;
    bool zmm;  // an AVX-512 feature: needs the opmask and zmm registers saved, not only ymm
  };
  static constexpr Known kKnown[] = {
      {"avx2", kLeaf7Ebx, 5, false},
      {"fma", kLeaf1Ecx, 12, false},
      {"f16c", kLeaf1Ecx, 29, false},
      {"avx512f", kLeaf7Ebx, 16, true},
      {"avx512dq", kLeaf7Ebx, 17, true},
      {"avx512bw", kLeaf7Ebx, 30, true},
      {"avx512vl", kLeaf7Ebx, 31, true},
      {"avx512bf16", kLeaf7_1Eax, 5, true},
  };
  const auto* known = std::find_if(std::begin(kKnown), std::end(kKnown),
                                   [&](const Known& k) { return k.name == feature; });
  if (known == std::end(kKnown)) {
    std::string names;
    for (const Known& k : kKnown) {
      names += names.empty() ? "" : ", ";
      names += k.name;
    }
    TORCH_CHECK_VALUE(false, "cpu_has: feature must be one of ", names, "; got '", feature, "'");
  }
#if defined(__x86_64__) || defined(__i386__)
  constexpr auto mask = [](std::string_view name) {
    for (const Known& k : kKnown) {
      if (k.name == name) return 1u << k.bit;
    }
    return 0u;
  };
  static_assert(mask("avx2") == bit_AVX2 && mask("fma") == bit_FMA && mask("f16c") == bit_F16C &&
                    mask("avx512f") == bit_AVX512F && mask("avx512dq") == bit_AVX512DQ &&
                    mask("avx512bw") == bit_AVX512BW && mask("avx512vl") == bit_AVX512VL &&
                    mask("avx512bf16") == bit_AVX512BF16,
                "kKnown's bits against the compiler's <cpuid.h>");
  static const X86Features f;
  const unsigned reg = known->reg == kLeaf1Ecx   ? f.leaf1_ecx
                       : known->reg == kLeaf7Ebx ? f.leaf7_ebx
                                                 : f.leaf7_1_eax;
  return (known->zmm ? f.avx512 : f.avx) && ((reg >> known->bit) & 1) != 0;
#else
  return false;
#endif
}

namespace {

#if defined(__x86_64__) || defined(__i386__)
#define CUSTOM_OPS_CPU_INIT() __builtin_cpu_init()
#define CUSTOM_OPS_CPU_IS(cpu) __builtin_cpu_is(#cpu)
#else
#define CUSTOM_OPS_CPU_INIT()
#define CUSTOM_OPS_CPU_IS(cpu) false
#endif
#define CUSTOM_OPS_CPU_HAS(feature) cpu_has(#feature)

using KernelFn = void (*)(const GdnParams&);

// A row of cpu/variants.def.
struct Variant {
  const char* name;
  const char* event;  // the profiler event of one CPU call
  const char* aten;
  bool built;
  bool (*runs_here)();
  bool (*default_here)();  // whether it may be the default on this CPU (where it runs)
  // The kernel for each accepted (input, state) dtype pair.
  KernelFn bf16_fp32, bf16_bf16, fp16_fp32, fp16_fp16;
};

#define CUSTOM_OPS_CPU_VARIANT(name, CAPABILITY, aten, flags, runs_here, default_here) \
  Variant{#name,                                                                     \
          "custom_ops::npu_fused_gdn_decode_cpu." #name,                             \
          #aten,                                                                     \
          kernel_built_##CAPABILITY,                                                 \
          [] {                                                                       \
            CUSTOM_OPS_CPU_INIT();                                                   \
            return static_cast<bool>(runs_here);                                     \
          },                                                                         \
          [] {                                                                       \
            CUSTOM_OPS_CPU_INIT();                                                   \
            return static_cast<bool>(default_here);                                  \
          },                                                                         \
          &fused_gdn_decode_kernel_##CAPABILITY<c10::BFloat16, float>,               \
          &fused_gdn_decode_kernel_##CAPABILITY<c10::BFloat16, c10::BFloat16>,       \
          &fused_gdn_decode_kernel_##CAPABILITY<c10::Half, float>,                   \
          &fused_gdn_decode_kernel_##CAPABILITY<c10::Half, c10::Half>},
const Variant kVariants[] = {
#include "cpu/variants.def"
};
#undef CUSTOM_OPS_CPU_VARIANT
constexpr Isa kNumVariants = static_cast<Isa>(sizeof(kVariants) / sizeof(kVariants[0]));

bool cpu_supports(Isa isa) {
  return kVariants[isa].built && kVariants[isa].runs_here();
}

// ATen's CPU capabilities in order; anything else (ZVECTOR, VSX, SVE...) counts as DEFAULT.
int aten_rank(const std::string& capability) {
  if (capability.find("AVX512") != std::string::npos) {
    return 2;
  }
  return capability.find("AVX2") != std::string::npos ? 1 : 0;
}

// The variant at load and for "auto": the last row of variants.def that this build and this CPU
// run, and that may be the default on this CPU (default_here), among those allowed by PyTorch's
// choice for its own CPU kernels (at::get_cpu_capability(), so
// ATEN_CPU_CAPABILITY=default|avx2|avx512 applies to this op as to ATen). (ATen trusts
// ATEN_CPU_CAPABILITY even above what the CPU has; cpu_supports does not.)
Isa default_isa() {
  const int limit = aten_rank(at::get_cpu_capability());
  Isa best = 0;
  for (Isa isa = 0; isa < kNumVariants; ++isa) {
    if (aten_rank(kVariants[isa].aten) <= limit && cpu_supports(isa) &&
        kVariants[isa].default_here()) {
      best = isa;
    }
  }
  return best;
}

bool parse_isa(const std::string& name, Isa* isa) {
  for (Isa candidate = 0; candidate < kNumVariants; ++candidate) {
    if (name == kVariants[candidate].name) {
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

// "'a', 'b' or 'c'"
std::string name_list(const std::vector<std::string>& names, const char* last_sep) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == names.size() ? last_sep : ", ") + ("'" + names[i] + "'");
  }
  return out;
}

// custom_ops.cpu applies CUSTOM_OPS_CPU_ISA at import (loudly: see there), through set_isa.
std::atomic<Isa> g_isa{default_isa()};
std::atomic<bool> g_specialize_k{true};

} // namespace

const char* isa_name(Isa isa) {
  return kVariants[isa].name;
}

Isa current_isa() {
  return g_isa.load(std::memory_order_relaxed);
}

std::vector<std::string> variant_names() {
  std::vector<std::string> names;
  for (const Variant& v : kVariants) {
    names.emplace_back(v.name);
  }
  return names;
}

std::vector<Isa> available_isas() {
  std::vector<Isa> isas;
  for (Isa isa = 0; isa < kNumVariants; ++isa) {
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
    std::vector<std::string> names = variant_names();
    names.insert(names.begin(), "auto");
    *error = "name must be " + name_list(names, " or ") + " (a CPU kernel variant), but got " +
             quoted(name);
    return false;
  } else if (!cpu_supports(isa)) {
    std::vector<std::string> runnable;
    for (Isa ok : available_isas()) {
      runnable.emplace_back(isa_name(ok));
    }
    *error = "name " + quoted(name) +
             " is a CPU kernel variant this build or this CPU lacks (available here: " +
             name_list(runnable, ", ") + ")";
    return false;
  }
  g_isa = isa;
  return true;
}

bool set_k_specialization(bool enabled) {
  return g_specialize_k.exchange(enabled);
}

namespace {

// Both overloads (GdnKernel): `out_arg` is null for the default one (allocated here after the
// checks).
at::Tensor run_op(const GdnArgs& args, at::Tensor* out_arg) {
  const auto& [mixed_qkv, a, b, a_log, dt_bias, state_ref, ssm_state_indices, scale,
               softplus_threshold] = args;
  const Variant& variant = kVariants[current_isa()];
  // Under torch.profiler: a child of the dispatcher's custom::npu_fused_gdn_decode event that
  // names the backend and the kernel variant that ran.
  RECORD_FUNCTION(variant.event, c10::ArrayRef<const c10::IValue>{});
  const GdnDims d = check_fused_gdn_decode_inputs(args);
  const int64_t B = d.batch.expect_int(), Hv = d.num_v_heads.expect_int();
  const int64_t V = d.head_v.expect_int();
  if (out_arg != nullptr) {
    check_fused_gdn_decode_out(*out_arg, d, args);
  }
  // The indices are read once: the slot check and the kernel both use this snapshot, so a write
  // to ssm_state_indices during the call (another thread; or this call's own state update when
  // the indices live inside state_ref) cannot hand the kernel a slot the check never saw.
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
  // Input bf16/fp16 and state fp32 or the input dtype (TypeError from the check otherwise).
  const bool bf16 = mixed_qkv.scalar_type() == at::kBFloat16;
  const bool fp32_state = state_ref.scalar_type() == at::kFloat;
  TORCH_INTERNAL_ASSERT((bf16 || mixed_qkv.scalar_type() == at::kHalf) &&
                        (fp32_state || state_ref.scalar_type() == mixed_qkv.scalar_type()));
  const KernelFn kernel = bf16 ? (fp32_state ? variant.bf16_fp32 : variant.bf16_bf16)
                               : (fp32_state ? variant.fp16_fp32 : variant.fp16_fp16);
  kernel(p);
  return out;
}

} // namespace

} // namespace custom_ops::cpu

TORCH_LIBRARY_IMPL(custom, CPU, m) {
  custom_ops::impl_fused_gdn_decode<&custom_ops::cpu::run_op>(m);
}
