// Shared declarations of custom::npu_fused_gdn_decode: the schema, the input check every
// backend runs, and the sizes it derives.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include <cstdint>
#include <memory>

namespace custom_ops {

// The drop-in schema of the vendor's torch_ops_extension (SPEC.md); declared once in ops.cpp.
inline constexpr const char* kFusedGdnDecodeSchema =
    "npu_fused_gdn_decode(Tensor mixed_qkv, Tensor a, Tensor b, Tensor a_log, Tensor dt_bias, "
    "Tensor(a!) state_ref, Tensor ssm_state_indices, float scale, *, "
    "float softplus_threshold=20.0) -> Tensor";

// The out variant: the same op writing into a caller's buffer (an engine's own output tensor).
inline constexpr const char* kFusedGdnDecodeOutSchema =
    "npu_fused_gdn_decode.out(Tensor mixed_qkv, Tensor a, Tensor b, Tensor a_log, "
    "Tensor dt_bias, Tensor(a!) state_ref, Tensor ssm_state_indices, float scale, *, "
    "float softplus_threshold=20.0, Tensor(b!) out) -> Tensor(b!)";

// Sizes derived by the check. SymInt so that the Meta kernel serves symbolic shapes too; on
// real tensors they are plain integers.
struct GdnDims {
  c10::SymInt batch;       // B
  c10::SymInt block_num;   // BlockNum (state slots)
  c10::SymInt num_heads;   // H, key heads
  c10::SymInt num_v_heads; // Hv, value heads
  c10::SymInt head_k;      // K
  c10::SymInt head_v;      // V
};

// Every backend (CPU, NPU, Meta, fallback) calls this first. Throws TypeError for dtype
// problems and ValueError for shape/value/device problems; touches no data.
GdnDims check_fused_gdn_decode_inputs(
    const at::Tensor& mixed_qkv,
    const at::Tensor& a,
    const at::Tensor& b,
    const at::Tensor& a_log,
    const at::Tensor& dt_bias,
    const at::Tensor& state_ref,
    const at::Tensor& ssm_state_indices,
    double scale,
    double softplus_threshold);

// The out variant's extra check: out is [B, 1, Hv, V], mixed_qkv's dtype and device, contiguous,
// sharing no memory with mixed_qkv or state_ref. Run after the input check.
void check_fused_gdn_decode_out(const at::Tensor& out, const GdnDims& d,
                                const at::Tensor& mixed_qkv, const at::Tensor& state_ref);

// The slot values, read once into host memory (4 bytes a row; no allocation up to 64 rows). The
// CPU op checks and runs on this copy, so nothing that writes ssm_state_indices during the call
// (another thread, or the call's own state update when the indices live inside state_ref) can
// reach the kernel unchecked.
class SlotSnapshot {
 public:
  explicit SlotSnapshot(const at::Tensor& ssm_state_indices_cpu);
  SlotSnapshot(const SlotSnapshot&) = delete;
  SlotSnapshot& operator=(const SlotSnapshot&) = delete;
  const int32_t* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  int32_t inline_[64];
  std::unique_ptr<int32_t[]> heap_;
  int32_t* data_;
  int64_t size_;
};

// Host-side slot check: every index < BlockNum, positive ones distinct. The CPU path always runs
// it; device backends only behind their debug switch.
void check_slot_indices(const int32_t* slots, int64_t n, int64_t block_num);
void check_slot_indices(const at::Tensor& ssm_state_indices_cpu, int64_t block_num);

} // namespace custom_ops
