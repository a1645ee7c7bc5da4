// Test-only PrivateUse1 device backed by host memory, so that custom::npu_fused_gdn_decode's
// PrivateUse1 kernel runs through the real dispatcher on a machine without an NPU.
//
// It provides what the binding and the tests touch: a host allocator that knows which blocks are
// live (the fake vendor library asks it whether the workspace and tensor storages are still
// allocated at launch), empty/empty_strided/as_strided/view/_copy_from kernels (everything else
// falls back to the CPU through copies), a device guard
// with per-thread current streams and native handles, and a stand-in for the two torch_npu C++
// functions the binding looks up by mangled name (c10_npu::getCurrentNPUStream and
// NPUStream::stream), declared as torch_npu's NPUStream.h declares them.
// Built by tests/test_npu_binding.py with torch.utils.cpp_extension.load.
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

namespace fake_npu {
namespace {

// Distinct fake aclrtStream values per source, so tests can tell which path produced one.
constexpr uintptr_t kGuardHandleBase = 0x6a0a0000;  // getStreamNativeHandle
constexpr uintptr_t kShimHandleBase = 0x5c100000;   // c10_npu::NPUStream::stream
constexpr size_t kMaxAlloc = size_t{1} << 36;      // larger requests fail as out of memory

std::mutex g_mu;
std::map<uintptr_t, size_t> g_live;  // base -> bytes
int64_t g_shim_stream_calls = 0, g_shim_flushes = 0;
int64_t g_device_to_host = 0, g_syncs = 0;  // copies to the CPU, stream/device synchronizations
bool g_null_stream = false;                 // NPUStream::stream returns null (failed flush)
std::map<const void*, int64_t> g_formats;   // storage base -> aclFormat, as npu_format_cast sets
thread_local c10::StreamId t_stream = 0;

void host_free(void* p) {
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_live.erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
}

struct HostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    TORCH_CHECK_WITH(OutOfMemoryError, n <= kMaxAlloc, "fake npu: out of memory allocating ", n,
                     " bytes");
    void* p = std::malloc(n == 0 ? 1 : n);
    TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr, "fake npu: malloc failed");
    {
      std::lock_guard<std::mutex> lock(g_mu);
      g_live[reinterpret_cast<uintptr_t>(p)] = n;
    }
    return {p, p, &host_free, c10::Device(c10::DeviceType::PrivateUse1, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &host_free;
  }
  void copy_data(void* dst, const void* src, std::size_t n) const override {
    std::memcpy(dst, src, n);
  }
};

HostAllocator g_allocator;

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return c10::DeviceType::PrivateUse1;
  }
  c10::Device exchangeDevice(c10::Device) const override {
    return c10::Device(c10::DeviceType::PrivateUse1, 0);
  }
  c10::Device getDevice() const override {
    return c10::Device(c10::DeviceType::PrivateUse1, 0);
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() <= 0, "fake npu has one device");
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(d.type(), 0), t_stream);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    auto old = getStream(s.device());
    t_stream = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return 1;
  }
  void* getStreamNativeHandle(const c10::Stream s) const override {
    return reinterpret_cast<void*>(kGuardHandleBase + s.id());
  }
  void synchronizeStream(const c10::Stream&) const override {
    std::lock_guard<std::mutex> lock(g_mu);
    g_syncs++;
  }
  void synchronizeDevice(const c10::DeviceIndex) const override {
    std::lock_guard<std::mutex> lock(g_mu);
    g_syncs++;
  }
};

// CPU tensor aliasing a fake-npu (host) tensor, same sizes/strides/offset.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.is_cpu()) {
    return t;
  }
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device>,
                               std::optional<bool>, std::optional<at::MemoryFormat> mf) {
  return at::detail::empty_generic(size, &g_allocator,
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), mf);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                         std::optional<at::Device>, std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  if (!self.is_cpu() && dst.is_cpu()) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_device_to_host++;
  }
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) {
    // The storage keeps our allocator, so the CPU resize logic grows it on this device.
    at::native::resize_(dst, self.sizes(), std::nullopt);
  }
  return copy_from(self, dst, false);
}

at::Tensor& fill_scalar(at::Tensor& self, const at::Scalar& v) {
  host_alias(self).fill_(v);
  return self;
}

} // namespace

// Whether [p, p + n) lies in one live allocation; handed to the fake vendor library.
extern "C" int fake_npu_is_live(const void* p, uint64_t n) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_live.upper_bound(a);
  if (it == g_live.begin()) {
    return 0;
  }
  --it;
  return a + n <= it->first + std::max<size_t>(it->second, 1) ? 1 : 0;
}

} // namespace fake_npu

// Stand-in for torch_npu's exported C++ stream API (NPUStream.h): same namespace, class layout
// (one c10::Stream) and signatures, so the compiler emits the same mangled names the binding
// looks up.
namespace c10_npu {
class NPUStream {
 public:
  explicit NPUStream(c10::Stream stream) : stream_(stream) {}
  ~NPUStream() {}  // as in torch_npu: makes the class returned through a hidden pointer
  void* stream(const bool need_empty) const;  // aclrtStream

 private:
  c10::Stream stream_;
};

__attribute__((visibility("default"))) NPUStream getCurrentNPUStream(
    c10::DeviceIndex device_index = -1) {
  return NPUStream(c10::Stream(c10::Stream::UNSAFE,
                               c10::Device(c10::DeviceType::PrivateUse1,
                                           device_index < 0 ? 0 : device_index),
                               fake_npu::t_stream));
}

__attribute__((visibility("default"))) void* NPUStream::stream(const bool need_empty) const {
  std::lock_guard<std::mutex> lock(fake_npu::g_mu);
  fake_npu::g_shim_stream_calls++;
  fake_npu::g_shim_flushes += need_empty ? 1 : 0;  // torch_npu flushes its task queue here
  if (fake_npu::g_null_stream) {
    return nullptr;  // as torch_npu when the flush fails
  }
  return reinterpret_cast<void*>(fake_npu::kShimHandleBase + stream_.id());
}
} // namespace c10_npu

// Stand-in for torch_npu's exported storage-format query (NPUFormat.h), same signature.
namespace at_npu::native {
__attribute__((visibility("default"))) int64_t get_npu_format(const at::Tensor& self) {
  std::lock_guard<std::mutex> lock(fake_npu::g_mu);
  const auto it = fake_npu::g_formats.find(self.storage().data());
  return it == fake_npu::g_formats.end() ? 2 : it->second;  // ACL_FORMAT_ND, torch_npu's default
}
} // namespace at_npu::native

C10_REGISTER_GUARD_IMPL(PrivateUse1, fake_npu::Guard);
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &fake_npu::g_allocator);

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &fake_npu::empty_memory_format);
  m.impl("empty_strided", &fake_npu::empty_strided);
  m.impl("_copy_from", &fake_npu::copy_from);
  m.impl("_copy_from_and_resize", &fake_npu::copy_from_and_resize);
  m.impl("fill_.Scalar", &fake_npu::fill_scalar);
  m.impl("as_strided", &at::native::as_strided_tensorimpl);
  m.impl("view", &at::native::view);
}

// Every other aten op runs on the CPU through copies (torch.library.opcheck compares results
// with ops like eq); custom::npu_fused_gdn_decode has its own PrivateUse1 kernel, so this never
// stands in for the binding under test.
namespace {
void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}
} // namespace

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}

namespace {
int64_t set_stream(int64_t id) {
  const int64_t old = fake_npu::t_stream;
  fake_npu::t_stream = id;
  return old;
}

std::vector<int64_t> stats() {
  std::lock_guard<std::mutex> lock(fake_npu::g_mu);
  return {fake_npu::g_shim_stream_calls, fake_npu::g_shim_flushes,
          static_cast<int64_t>(fake_npu::g_live.size()), fake_npu::g_device_to_host,
          fake_npu::g_syncs};
}

void set_format(const at::Tensor& t, int64_t format) {
  std::lock_guard<std::mutex> lock(fake_npu::g_mu);
  fake_npu::g_formats[t.storage().data()] = format;
}

void clear_formats() {
  std::lock_guard<std::mutex> lock(fake_npu::g_mu);
  fake_npu::g_formats.clear();
}

bool set_null_stream(bool on) {
  std::lock_guard<std::mutex> lock(fake_npu::g_mu);
  const bool old = fake_npu::g_null_stream;
  fake_npu::g_null_stream = on;
  return old;
}

int64_t live_checker() {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(&fake_npu::fake_npu_is_live));
}
} // namespace

// Test controls: the current stream id of this thread, counters [shim stream() calls, of which
// with need_empty, live allocations, device-to-host copies, synchronizations], the address of
// fake_npu_is_live, the storage format get_npu_format reports for a tensor's storage, and whether
// NPUStream::stream fails.
TORCH_LIBRARY(fake_npu, m) {
  m.def("set_stream(int id) -> int", &set_stream);
  m.def("set_format(Tensor t, int format) -> ()", &set_format);
  m.def("clear_formats() -> ()", &clear_formats);
  m.def("set_null_stream(bool on) -> bool", &set_null_stream);
  m.def("stats() -> int[]", &stats);
  m.def("live_checker() -> int", &live_checker);
  m.def("handle_bases() -> int[]", []() -> std::vector<int64_t> {
    return {static_cast<int64_t>(fake_npu::kGuardHandleBase),
            static_cast<int64_t>(fake_npu::kShimHandleBase)};
  });
}
