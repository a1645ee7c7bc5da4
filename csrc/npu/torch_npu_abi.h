// What the NPU binding assumes about torch_npu's C++ ABI: the functions it looks up by mangled name
// in the already loaded libtorch_npu.so, and a mirror of the class one of them returns. Nothing
// here includes torch_npu. tests/test_torch_npu_abi.py compiles these declarations next to the
// headers of the real torch-npu wheel and checks the names against its libtorch_npu.so.
#pragma once

#include <cstdint>

#include <c10/core/Stream.h>

namespace at {
class Tensor;
}

namespace custom_ops::npu {

// Mirrors c10_npu::NPUStream (torch_npu NPUStream.h): its only data member is a c10::Stream and it
// has a user-provided destructor (`~NPUStream() {}`), which makes it non-trivial for calls, so the
// Itanium C++ ABI returns it through a hidden result pointer (x86-64: rdi; aarch64: x8) rather
// than in registers. The empty destructor here gives NpuStreamAbi the same convention.
struct NpuStreamAbi {
  c10::Stream stream;
  ~NpuStreamAbi() {}  // NOLINT: must stay user-provided, see above
};
static_assert(sizeof(NpuStreamAbi) == sizeof(c10::Stream), "NPUStream layout");

// c10_npu::getCurrentNPUStream(c10::DeviceIndex)
using GetCurrentNpuStreamFn = NpuStreamAbi (*)(c10::DeviceIndex);
// aclrtStream c10_npu::NPUStream::stream(bool need_empty) const; `this` is the first argument.
using NpuStreamStreamFn = void* (*)(const NpuStreamAbi*, bool);
// int64_t at_npu::native::get_npu_format(const at::Tensor&): the storage format (aclFormat).
using GetNpuFormatFn = int64_t (*)(const at::Tensor&);

// The mangled names assume c10::DeviceIndex is int8_t ('a'), as in the torch this builds against.
static_assert(sizeof(c10::DeviceIndex) == 1, "update the mangled name of getCurrentNPUStream");
inline constexpr const char* kGetCurrentNpuStream = "_ZN7c10_npu19getCurrentNPUStreamEa";
inline constexpr const char* kNpuStreamStream = "_ZNK7c10_npu9NPUStream6streamEb";
inline constexpr const char* kGetNpuFormat = "_ZN6at_npu6native14get_npu_formatERKN2at6TensorE";
inline constexpr const char* kTorchNpuSymbols[] = {kGetCurrentNpuStream, kNpuStreamStream,
                                                   kGetNpuFormat};

} // namespace custom_ops::npu
