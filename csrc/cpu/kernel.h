// Interface between the CPU op (fused_gdn_decode_cpu.cpp) and the kernel bodies compiled once per
// row of cpu/variants.def (kernel_<name>.cpp). Plain pointers and element strides only, so the
// kernel files need no Tensor headers and compile quickly.
//
// The kernel files are compiled with instruction-set flags: nothing that could also be linked into
// the rest of the library (error messages, dtype dispatch) belongs there; the CPU op does it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace custom_ops::cpu {

struct GdnParams {
  // Sizes (validated by the shared check).
  int64_t batch, num_heads, num_v_heads, head_k, head_v;
  // mixed_qkv (B, 2*H*K + Hv*V), any strides.
  const void* mixed_qkv;
  int64_t qkv_stride_row, qkv_stride_col;
  // a, b (B, Hv), any strides.
  const void* a;
  int64_t a_stride_row, a_stride_col;
  const void* b;
  int64_t b_stride_row, b_stride_col;
  // a_log (Hv,) float32, dt_bias (Hv,) in the input dtype.
  const float* a_log;
  int64_t a_log_stride;
  const void* dt_bias;
  int64_t dt_bias_stride;
  // state (BlockNum, Hv, V, K), updated in place: each slot contiguous, slots state_stride_slot
  // elements apart (>= Hv*V*K; an engine's pool may interleave other data between slots).
  void* state;
  int64_t state_stride_slot;
  // ssm_state_indices (B,) int32; index <= 0 marks an invalid row.
  const int32_t* indices;
  // out (B, 1, Hv, V), contiguous, input dtype.
  void* out;
  float scale;
  float softplus_threshold;
  // Use the row kernels specialised on K = 64, 128, 256 (same bits as the generic one; false
  // forces the generic one, for tests).
  bool specialize_k;
};

// One kernel body per row of cpu/variants.def, instantiated for T (input dtype) in
// {c10::BFloat16, c10::Half} and S (state dtype) in {float, T}; each computes the whole op
// described by GdnParams. A variant that this build leaves out (its compiler flags fail, or a
// CUSTOM_OPS_NO_* switch) is compiled as a stub: kernel_built_<CAPABILITY> is false and its body
// is never called.
#define CUSTOM_OPS_CPU_VARIANT(name, CAPABILITY, aten, flags, runs_here, default_here) \
  template <typename T, typename S>                                                     \
  void fused_gdn_decode_kernel_##CAPABILITY(const GdnParams& p);                        \
  extern const bool kernel_built_##CAPABILITY;
#include "cpu/variants.def"
#undef CUSTOM_OPS_CPU_VARIANT

// Whether this CPU has a feature that cpu/variants.def names (CUSTOM_OPS_CPU_HAS: GCC's
// __builtin_cpu_supports names); false off x86. ValueError for a name it does not know.
bool cpu_has(std::string_view feature);

// A variant: its index in cpu/variants.def, in order of preference.
using Isa = int;

const char* isa_name(Isa isa);
Isa current_isa();
// Every variant's name (built or not), in order of preference.
std::vector<std::string> variant_names();
std::vector<Isa> available_isas();
// A variant's name or "auto" (the default: see default_isa in fused_gdn_decode_cpu.cpp). False
// with *error set if unknown or not runnable here.
bool set_isa(const std::string& name, std::string* error);
// Whether the CPU op uses the K-specialised row kernels (default true); returns the old setting.
bool set_k_specialization(bool enabled);

} // namespace custom_ops::cpu
