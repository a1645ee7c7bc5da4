// ABI check of the NPU binding against the headers of the torch-npu wheel (compiled, never run, by
// tests/test_torch_npu_abi.py, which appends static_asserts generated from csrc/npu/acl_api.h).
// A failed static_assert or a missing declaration fails the compile and so the test.
#include <cstdint>
#include <type_traits>

// Our declarations first, in a namespace of their own so that they can sit next to the real ones.
namespace ours {
#include "npu/acl_api.h"
}

#include <acl/acl_base.h>
#include <acl/acl_rt.h>

#include "npu/torch_npu_abi.h"
#include "torch_npu/csrc/core/npu/NPUFormat.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/core/npu/interface/OpInterface.h"

// op-plugin's declarations of the aclnn tensor API (op_api_common_base.h, whose other includes
// need all of torch_npu), inserted by the test on the next line, verbatim.
@OP_PLUGIN_TYPEDEFS@

namespace abi_check {

// Maps a type spelled with our declarations to the same type spelled with the shipped ones.
template <class T> struct Shipped { using type = T; };
template <class T> using shipped_t = typename Shipped<T>::type;
template <class T> struct Shipped<T*> { using type = shipped_t<T>*; };
template <class T> struct Shipped<const T> { using type = const shipped_t<T>; };
template <class R, class... A> struct Shipped<R (*)(A...)> {
  using type = shipped_t<R> (*)(shipped_t<A>...);
};
template <> struct Shipped<ours::aclDataType> { using type = ::aclDataType; };
template <> struct Shipped<ours::aclFormat> { using type = ::aclFormat; };
template <> struct Shipped<ours::aclmdlRICaptureStatus> { using type = ::aclmdlRICaptureStatus; };
template <> struct Shipped<ours::aclTensor> { using type = ::aclTensor; };
template <> struct Shipped<ours::aclOpExecutor> { using type = ::aclOpExecutor; };
template <> struct Shipped<custom_ops::npu::NpuStreamAbi> { using type = c10_npu::NPUStream; };

// A const member function as the free function the binding calls it through (`this` first).
template <class M> struct AsFree;
template <class R, class C, class... A> struct AsFree<R (C::*)(A...) const> {
  using type = R (*)(const C*, A...);
};

template <class Ours, class Real> constexpr bool same_enum =
    sizeof(Ours) == sizeof(Real) && std::is_signed_v<std::underlying_type_t<Ours>> ==
                                        std::is_signed_v<std::underlying_type_t<Real>>;
static_assert(same_enum<ours::aclDataType, ::aclDataType>, "aclDataType size");
static_assert(same_enum<ours::aclFormat, ::aclFormat>, "aclFormat size");
static_assert(same_enum<ours::aclmdlRICaptureStatus, ::aclmdlRICaptureStatus>,
              "aclmdlRICaptureStatus size");
static_assert(std::is_same_v<ours::aclnnStatus, c10_npu::opapi::aclnnStatus>, "aclnnStatus");
static_assert(std::is_same_v<ours::aclError, ::aclError>, "aclError");
static_assert(std::is_same_v<ours::aclrtStream, ::aclrtStream>, "aclrtStream");
static_assert(std::is_same_v<ours::aclmdlRI, ::aclmdlRI>, "aclmdlRI");

// NPUStream as returned by value and called through `this`.
using custom_ops::npu::NpuStreamAbi;
static_assert(sizeof(NpuStreamAbi) == sizeof(c10_npu::NPUStream), "NPUStream size");
static_assert(alignof(NpuStreamAbi) == alignof(c10_npu::NPUStream), "NPUStream alignment");
static_assert(!std::is_polymorphic_v<c10_npu::NPUStream>, "NPUStream has a vtable");
static_assert(std::is_trivially_destructible_v<NpuStreamAbi> ==
                  std::is_trivially_destructible_v<c10_npu::NPUStream>,
              "NPUStream destructor triviality (decides the return convention)");
static_assert(std::is_trivially_copy_constructible_v<NpuStreamAbi> ==
                  std::is_trivially_copy_constructible_v<c10_npu::NPUStream>,
              "NPUStream copy constructor triviality (decides the return convention)");
static_assert(std::is_same_v<shipped_t<custom_ops::npu::GetCurrentNpuStreamFn>,
                             decltype(&c10_npu::getCurrentNPUStream)>,
              "c10_npu::getCurrentNPUStream signature");
using StreamMember = aclrtStream (c10_npu::NPUStream::*)(bool) const;
static_assert(std::is_same_v<shipped_t<custom_ops::npu::NpuStreamStreamFn>,
                             typename AsFree<StreamMember>::type>,
              "c10_npu::NPUStream::stream(bool) signature");
static_assert(std::is_same_v<custom_ops::npu::GetNpuFormatFn,
                             decltype(&at_npu::native::get_npu_format)>,
              "at_npu::native::get_npu_format signature");

} // namespace abi_check

// References that make the object file name the mangled symbols of the real declarations; the
// test compares them with the names the binding looks up.
extern "C" {
const void* custom_ops_abi_functions[] = {
    reinterpret_cast<const void*>(&c10_npu::getCurrentNPUStream),
    reinterpret_cast<const void*>(&at_npu::native::get_npu_format)};
}
abi_check::StreamMember custom_ops_abi_stream_member = &c10_npu::NPUStream::stream;

// GENERATED: one static_assert per enumerator and per function type of npu/acl_api.h.
