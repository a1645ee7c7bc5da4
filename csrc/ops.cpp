// The schema, declared once, the internal helper ops, the environment switch reader, and the
// (empty) Python module. Importing custom_ops._C runs the static registrations of every backend
// file linked into it.
#include <Python.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

#include "core_clock.h"
#include "cpu/kernel.h"
#include "fused_gdn_decode.h"

namespace custom_ops {

bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) {
    return false;
  }
  std::string v(value);
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  return v == "1" || v == "true" || v == "on" || v == "yes";
}

} // namespace custom_ops

TORCH_LIBRARY(custom, m) {
  m.def(custom_ops::kFusedGdnDecodeSchema);
  m.def(custom_ops::kFusedGdnDecodeOutSchema);
}

// Helpers for the Python backends and the package, kept out of the `custom` namespace. Defined
// with a catch-all kernel (CompositeImplicitAutograd), so they run for tensors on any device (CUDA,
// XPU, Meta, ...) and, for the ISA helpers, with no tensor argument at all.
TORCH_LIBRARY(custom_ops_internal, m) {
  // The shared input check on real tensors of any device: devices, dtypes, shapes, strides,
  // finiteness of the floats. Reads no tensor data.
  // (state_ref by value: GdnArgs holds the op's mutable reference; this op only reads it.)
  m.def("check_inputs(Tensor mixed_qkv, Tensor a, Tensor b, Tensor a_log, Tensor dt_bias, "
        "Tensor state_ref, Tensor ssm_state_indices, float scale, float softplus_threshold) -> ()",
        [](const at::Tensor& mixed_qkv, const at::Tensor& a, const at::Tensor& b,
           const at::Tensor& a_log, const at::Tensor& dt_bias, at::Tensor state_ref,
           const at::Tensor& ssm_state_indices, double scale, double softplus_threshold) {
          custom_ops::check_fused_gdn_decode_inputs({mixed_qkv, a, b, a_log, dt_bias, state_ref,
                                                     ssm_state_indices, scale,
                                                     softplus_threshold});
        });
  // The input check and the out variant's check of out, for the Python backends' out overload.
  m.def("check_inputs_out(Tensor mixed_qkv, Tensor a, Tensor b, Tensor a_log, Tensor dt_bias, "
        "Tensor state_ref, Tensor ssm_state_indices, float scale, float softplus_threshold, "
        "Tensor out) -> ()",
        [](const at::Tensor& mixed_qkv, const at::Tensor& a, const at::Tensor& b,
           const at::Tensor& a_log, const at::Tensor& dt_bias, at::Tensor state_ref,
           const at::Tensor& ssm_state_indices, double scale, double softplus_threshold,
           const at::Tensor& out) {
          const custom_ops::GdnArgs args{mixed_qkv, a, b, a_log, dt_bias, state_ref,
                                         ssm_state_indices, scale, softplus_threshold};
          custom_ops::check_fused_gdn_decode_out(
              out, custom_ops::check_fused_gdn_decode_inputs(args), args);
        });
  // The slot check with the CPU path's exact rules and messages. Takes CPU int32 indices.
  m.def("check_slot_indices(Tensor indices, int block_num) -> ()",
        [](const at::Tensor& indices, int64_t block_num) {
          custom_ops::check_slot_indices(indices, block_num);
        });
  // The core's clock in GHz (0 where it cannot be read): `python -m benchmarks` prints it around
  // each line of its per-variant table.
  m.def("core_clock_ghz() -> float", []() { return custom_ops::core_clock_ghz(); });
  // Every CPU kernel variant (csrc/cpu/variants.def), built or not, in order of preference.
  m.def("cpu_variants() -> str[]", []() { return custom_ops::cpu::variant_names(); });
  // Whether this CPU has a feature that csrc/cpu/variants.def names (GCC's
  // __builtin_cpu_supports names), from CPUID; the tests compare it with Linux's /proc/cpuinfo.
  m.def("cpu_has(str feature) -> bool",
        [](const std::string& feature) { return custom_ops::cpu::cpu_has(feature); });
  // Whether the CPU kernel runs on torch's intra-op threads: built with OpenMP, as GCC builds are
  // (setup.py builds it without under clang, whose OpenMP runtime is not torch's).
  m.def("cpu_threaded() -> bool", []() {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  });
  // The CPU kernel variant in use.
  m.def("cpu_isa() -> str", []() -> std::string {
    return custom_ops::cpu::isa_name(custom_ops::cpu::current_isa());
  });
  // The variants this build and this CPU can run.
  m.def("cpu_isas() -> str[]", []() {
    std::vector<std::string> names;
    for (auto isa : custom_ops::cpu::available_isas()) {
      names.emplace_back(custom_ops::cpu::isa_name(isa));
    }
    return names;
  });
  // Switches the variant ("auto" or a name of cpu_variants()); returns the previous one.
  // ValueError for an unknown name or one this build/CPU cannot run.
  m.def("set_cpu_isa(str name) -> str", [](const std::string& name) -> std::string {
    std::string previous = custom_ops::cpu::isa_name(custom_ops::cpu::current_isa());
    std::string error;
    TORCH_CHECK_VALUE(custom_ops::cpu::set_isa(name, &error), "set_cpu_isa: ", error);
    return previous;
  });
  // Whether the CPU kernel uses its row kernels specialised on K = 64, 128, 256 (default true;
  // they give the generic kernel's bits, which tests check with false); returns the old setting.
  m.def("set_cpu_k_specialization(bool enabled) -> bool",
        [](bool enabled) { return custom_ops::cpu::set_k_specialization(enabled); });
}

// custom_ops._C is an empty Python module (as in pytorch/extension-cpp): importing it loads this
// library, whose static TORCH_LIBRARY blocks register everything above and every backend.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
