// Our own minimal declarations of the CANN ACL / aclnn C API used by the NPU binding. They are
// written from the public CANN documentation (acl_base.h, acl_op_api.h / aclnn/acl_meta.h and the
// FusedGdnDecode op's aclnn docs): nothing here includes or links CANN, every function is
// resolved at run time by vendor_loader.cpp.
#pragma once

#include <cstdint>

extern "C" {

typedef struct aclTensor aclTensor;          // opaque, made by aclCreateTensor
typedef struct aclOpExecutor aclOpExecutor;  // opaque, made by an op's GetWorkspaceSize phase
typedef void* aclrtStream;
typedef int32_t aclnnStatus;
typedef int aclError;      // acl_base.h
typedef void* aclmdlRI;    // acl_rt.h: a captured model runtime instance

// acl_base.h values (stable ABI).
typedef enum {
  ACL_DT_UNDEFINED = -1,
  ACL_FLOAT = 0,
  ACL_FLOAT16 = 1,
  ACL_INT32 = 3,
  ACL_INT64 = 9,
  ACL_BF16 = 27,
} aclDataType;

// Storage formats. The binding describes tensors as ND and accepts only formats whose storage is
// the plain row-major layout of the tensor's sizes (ND, NCHW, NCDHW); the others are named in
// its error messages.
typedef enum {
  ACL_FORMAT_UNDEFINED = -1,
  ACL_FORMAT_NCHW = 0,
  ACL_FORMAT_NHWC = 1,
  ACL_FORMAT_ND = 2,
  ACL_FORMAT_NC1HWC0 = 3,
  ACL_FORMAT_FRACTAL_Z = 4,
  ACL_FORMAT_NDHWC = 27,
  ACL_FORMAT_FRACTAL_NZ = 29,
  ACL_FORMAT_NCDHW = 30,
  ACL_FORMAT_NDC1HWC0 = 32,
} aclFormat;

// acl_rt.h: whether a stream is being captured into an ACL graph (aclmdlRICaptureBegin).
typedef enum {
  ACL_MODEL_RI_CAPTURE_STATUS_NONE = 0,
  ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE = 1,
  ACL_MODEL_RI_CAPTURE_STATUS_INVALIDATED = 2,
} aclmdlRICaptureStatus;

// aclnn status codes the FusedGdnDecode docs name.
enum : int32_t {
  ACLNN_SUCCESS = 0,
  ACLNN_ERR_PARAM_NULLPTR = 161001,
  ACLNN_ERR_PARAM_INVALID = 161002,
  ACLNN_ERR_INNER_NULLPTR = 561103,  // an inner step failed; for FusedGdnDecode, its tiling
};

// Signatures (as function-pointer types, since nothing is linked).
using aclCreateTensorFn = aclTensor* (*)(const int64_t* view_dims, uint64_t view_dims_num,
                                         aclDataType data_type, const int64_t* stride,
                                         int64_t offset, aclFormat format,
                                         const int64_t* storage_dims, uint64_t storage_dims_num,
                                         void* tensor_data);
using aclDestroyTensorFn = aclnnStatus (*)(const aclTensor* tensor);
using aclSetAclOpExecutorRepeatableFn = aclnnStatus (*)(aclOpExecutor* executor);
using aclDestroyAclOpExecutorFn = aclnnStatus (*)(aclOpExecutor* executor);
using aclGetRecentErrMsgFn = const char* (*)();
using aclmdlRICaptureGetInfoFn = aclError (*)(aclrtStream stream, aclmdlRICaptureStatus* status,
                                              aclmdlRI* modelRI);

using aclnnFusedGdnDecodeGetWorkspaceSizeFn = aclnnStatus (*)(
    const aclTensor* mixedQkv, const aclTensor* a, const aclTensor* b, const aclTensor* aLog,
    const aclTensor* dtBias, aclTensor* stateRef, const aclTensor* ssmStateIndices, float scale,
    float softplusThreshold, aclTensor* out, uint64_t* workspaceSize, aclOpExecutor** executor);
using aclnnFusedGdnDecodeFn = aclnnStatus (*)(void* workspace, uint64_t workspaceSize,
                                              aclOpExecutor* executor, aclrtStream stream);

} // extern "C"
