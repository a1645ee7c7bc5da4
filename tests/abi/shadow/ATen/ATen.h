// Test stand-in for <ATen/ATen.h> as torch_npu's NPUFormat.h uses it: only names, no tensor
// library (the ABI check compiles declarations, never calls them).
#pragma once
#include <optional>
#include <vector>
#include <c10/core/TensorOptions.h>
#include <c10/util/ArrayRef.h>
namespace at {
class Tensor;
using c10::IntArrayRef;
}
