// Run-time binding to the vendor pieces of the NPU path: the aclnn entry points of the
// FusedGdnDecode op package, the ACL tensor API they take, and the current aclrtStream of
// torch_npu. Nothing is linked: everything is found with dlopen/dlsym at first use, so the
// extension builds and imports on hosts without CANN or torch_npu.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

namespace at {
class Tensor;
}

#include "npu/acl_api.h"

namespace custom_ops::npu {

struct VendorApi {
  std::string op_library;    // library that provided the two aclnn entry points
  std::string meta_library;  // where aclCreateTensor/aclDestroyTensor came from
  aclnnFusedGdnDecodeGetWorkspaceSizeFn get_workspace_size = nullptr;
  aclnnFusedGdnDecodeFn launch = nullptr;
  aclCreateTensorFn create_tensor = nullptr;
  aclDestroyTensorFn destroy_tensor = nullptr;
  // Optional: used only when present.
  aclGetRecentErrMsgFn recent_error = nullptr;
  aclSetAclOpExecutorRepeatableFn set_executor_repeatable = nullptr;
  aclDestroyAclOpExecutorFn destroy_executor = nullptr;
  aclmdlRICaptureGetInfoFn capture_info = nullptr;
};

// The vendor API, searched for at first use, in the order of docs/spec.md ("The vendor pieces
// (NPU path)") and docs/npu.md ("How the binding finds the vendor pieces"): each
// ASCEND_CUSTOM_OPP_PATH entry's op_api/lib/libcust_opapi.so, then $ASCEND_OPP_PATH/vendors/<name>/op_api/lib/libcust_opapi.so in
// vendors/config.ini load_priority order, then the built-in libopapi libraries. Throws a
// RuntimeError listing every place searched and why each was skipped.
std::shared_ptr<const VendorApi> vendor_api();

// Forgets the cached result (and the stream provider) so the next call searches again with the
// current environment. Libraries already opened stay loaded. For tests and diagnostics.
void reset_vendor_api();

// The error text of the vendor's last failure, or "" when none can be had.
std::string recent_vendor_error(const VendorApi& api);

// The aclrtStream of the current stream of `device` (a PrivateUse1 device), see vendor_loader.cpp.
aclrtStream current_acl_stream(const c10::Device& device);

// The storage format (aclFormat) torch_npu records for `t`, from its exported
// at_npu::native::get_npu_format; nullopt where torch_npu is not loaded (no private formats).
std::optional<int64_t> torch_npu_storage_format(const at::Tensor& t);

// Whether `stream` is being captured into an ACL graph (false when ACL cannot say).
bool stream_is_capturing(const VendorApi& api, aclrtStream stream);

// The mangled names looked up in libtorch_npu.so (for the ABI test).
std::vector<std::string> torch_npu_symbols();

// One line per resolved piece (libraries, stream provider), or the search error. For
// torch.ops.custom_ops_npu.vendor_info() and the verification step of docs/npu.md ("Verify on the
// Ascend host").
std::string describe_vendor();

} // namespace custom_ops::npu
