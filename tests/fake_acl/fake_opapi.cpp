// Test double of a CANN op package's libcust_opapi.so for custom::npu_fused_gdn_decode.
//
// It exports the ACL tensor API (aclCreateTensor/aclDestroyTensor, executor release,
// aclGetRecentErrMsg) and the two aclnnFusedGdnDecode phases, and really computes the op on host
// memory from nothing but the aclTensor descriptions it was given (dims, strides, offset, dtype,
// storage extent, base pointer). So a wrong stride, offset, dtype enum or argument order in the
// binding shows up in the numbers. It validates like the vendor's aclnn layer, enforces the
// two-phase protocol, records every call, and can be told to fail with a given status.
//
// Written for this project from the public API description (docs/spec.md, "The vendor pieces
// (NPU path)"); no vendor code.
// Build: g++ -std=c++17 -O2 -shared -fPIC fake_opapi.cpp -o libcust_opapi.so
//        (-DFAKE_WITHOUT_OP: a library without the aclnn entry points, for search-order tests)
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#define EXPORT extern "C" __attribute__((visibility("default")))

// Values of the public ACL headers.
enum { kFloat = 0, kFloat16 = 1, kInt32 = 3, kInt64 = 9, kBf16 = 27 };
enum { kFormatNd = 2 };
enum { kOk = 0, kNullptr = 161001, kInvalid = 161002 };

struct aclTensor {
  std::vector<int64_t> dims, strides, storage_dims;
  int64_t offset = 0;
  int dtype = -1;
  int format = -1;
  void* data = nullptr;
};

struct aclOpExecutor {
  const aclTensor* t[8];  // mixed, a, b, a_log, dt_bias, state, indices, out
  float scale = 0, threshold = 0;
  uint64_t workspace_size = 0;
  bool repeatable = false;
};

namespace {

std::mutex g_mu;
std::set<const aclTensor*> g_tensors;
std::set<const aclOpExecutor*> g_executors;
std::map<std::string, int64_t> g_count;
std::string g_log;         // call sequence, e.g. "C C ... W L D ..."
std::string g_error;       // for aclGetRecentErrMsg
uintptr_t g_last_stream = 0;
uint64_t g_workspace_size = 256;
int g_fail_phase = 0, g_fail_status = 0;
int g_capture_status = 0;  // what aclmdlRICaptureGetInfo reports (1: the stream is being captured)
std::string g_fail_msg;
using LiveFn = int (*)(const void*, uint64_t);
LiveFn g_live = nullptr;  // optional: asks the test device whether [p, p+n) is allocated

int fail(int status, const std::string& msg) {
  g_error = msg;
  return status;
}

size_t item_size(int dtype) {
  switch (dtype) {
    case kFloat: case kInt32: return 4;
    case kFloat16: case kBf16: return 2;
    case kInt64: return 8;
  }
  return 0;
}

int64_t numel(const aclTensor* t) {
  int64_t n = 1;
  for (auto d : t->dims) n *= d;
  return n;
}

int64_t storage_elems(const aclTensor* t) {
  int64_t n = 1;
  for (auto d : t->storage_dims) n *= d;
  return n;
}

// The view must lie inside the storage it claims, with non-negative strides.
bool view_fits(const aclTensor* t, std::string* why) {
  int64_t last = t->offset;
  if (t->offset < 0) { *why = "negative offset"; return false; }
  for (size_t d = 0; d < t->dims.size(); ++d) {
    if (t->strides[d] < 0) { *why = "negative stride"; return false; }
    last += (t->dims[d] - 1) * t->strides[d];
  }
  if (numel(t) > 0 && last >= storage_elems(t)) {
    *why = "view reaches element " + std::to_string(last) + " of a storage of " +
           std::to_string(storage_elems(t)) + " elements";
    return false;
  }
  return true;
}

bool contiguous(const aclTensor* t) {
  int64_t expect = 1;
  for (size_t d = t->dims.size(); d-- > 0;) {
    if (t->dims[d] != 1 && t->strides[d] != expect) return false;
    expect *= t->dims[d];
  }
  return true;
}

bool storage_live(const aclTensor* t) {
  return g_live == nullptr ||
         g_live(t->data, static_cast<uint64_t>(storage_elems(t)) * item_size(t->dtype));
}

float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Element access through the description: linear element index = offset + sum(i_d * stride_d).
int64_t at(const aclTensor* t, std::initializer_list<int64_t> idx) {
  int64_t e = t->offset;
  size_t d = 0;
  for (auto i : idx) e += i * t->strides[d++];
  return e;
}

float load(const aclTensor* t, int64_t e) {
  switch (t->dtype) {
    case kFloat: return static_cast<const float*>(t->data)[e];
    case kFloat16: return static_cast<float>(static_cast<const _Float16*>(t->data)[e]);
    case kBf16: return bf16_to_float(static_cast<const uint16_t*>(t->data)[e]);
    case kInt32: return static_cast<float>(static_cast<const int32_t*>(t->data)[e]);
  }
  return NAN;
}

void store(const aclTensor* t, int64_t e, float v) {
  switch (t->dtype) {
    case kFloat: static_cast<float*>(t->data)[e] = v; break;
    case kFloat16: static_cast<_Float16*>(t->data)[e] = static_cast<_Float16>(v); break;
    case kBf16: static_cast<uint16_t*>(t->data)[e] = float_to_bf16(v); break;
  }
}

// The op (docs/spec.md, "Semantics (all arithmetic in float32)"), all in float32.
void compute(const aclOpExecutor& x) {
  const aclTensor *mixed = x.t[0], *ta = x.t[1], *tb = x.t[2], *alog = x.t[3], *dtb = x.t[4],
                  *state = x.t[5], *idx = x.t[6], *out = x.t[7];
  const int64_t B = mixed->dims[0], Hv = state->dims[1], V = state->dims[2], K = state->dims[3];
  const int64_t H = (mixed->dims[1] - Hv * V) / (2 * K);
  std::vector<float> q(K), k(K), S(V * K), u(V);
  for (int64_t i = 0; i < B; ++i) {
    const int64_t s = static_cast<const int32_t*>(idx->data)[at(idx, {i})];
    for (int64_t j = 0; j < Hv; ++j) {
      if (s <= 0) {
        for (int64_t v = 0; v < V; ++v) store(out, at(out, {i, 0, j, v}), 0.0f);
        continue;
      }
      const int64_t h = j / (Hv / H);
      float sq = 0, sk = 0;
      for (int64_t c = 0; c < K; ++c) {
        q[c] = load(mixed, at(mixed, {i, h * K + c}));
        k[c] = load(mixed, at(mixed, {i, (H + h) * K + c}));
        sq += q[c] * q[c];
        sk += k[c] * k[c];
      }
      const float rq = x.scale / std::sqrt(sq + 1e-6f), rk = 1.0f / std::sqrt(sk + 1e-6f);
      for (int64_t c = 0; c < K; ++c) { q[c] *= rq; k[c] *= rk; }
      const float xg = load(ta, at(ta, {i, j})) + load(dtb, at(dtb, {j}));
      const float sp = std::fmax(xg, std::log(1.0f + std::exp(std::fmin(xg, x.threshold))));
      const float decay = std::exp(-std::exp(load(alog, at(alog, {j}))) * sp);
      const float beta = 1.0f / (1.0f + std::exp(-load(tb, at(tb, {i, j}))));
      for (int64_t v = 0; v < V; ++v) {
        float kv = 0;
        for (int64_t c = 0; c < K; ++c) {
          float& e = S[v * K + c];
          e = load(state, at(state, {s, j, v, c})) * decay;
          kv += e * k[c];
        }
        const float vv = load(mixed, at(mixed, {i, 2 * H * K + j * V + v}));
        u[v] = beta * (vv - kv);
      }
      for (int64_t v = 0; v < V; ++v) {
        float o = 0;
        for (int64_t c = 0; c < K; ++c) {
          float& e = S[v * K + c];
          e += u[v] * k[c];
          o += e * q[c];
          store(state, at(state, {s, j, v, c}), e);
        }
        store(out, at(out, {i, 0, j, v}), o);
      }
    }
  }
}

const char* dtype_name(int d) {
  switch (d) {
    case kFloat: return "FLOAT";
    case kFloat16: return "FLOAT16";
    case kBf16: return "BF16";
    case kInt32: return "INT32";
    case kInt64: return "INT64";
  }
  return "UNKNOWN";
}

}  // namespace

// ---- ACL tensor API --------------------------------------------------------------------------

EXPORT aclTensor* aclCreateTensor(const int64_t* view_dims, uint64_t view_dims_num, int data_type,
                                  const int64_t* stride, int64_t offset, int format,
                                  const int64_t* storage_dims, uint64_t storage_dims_num,
                                  void* tensor_data) {
  std::lock_guard<std::mutex> lock(g_mu);
  const int64_t nth = ++g_count["aclCreateTensor"];
  g_log += "C ";
  if (g_fail_phase == 3 && nth == g_fail_status) {  // phase 3: the n-th create fails
    g_error = g_fail_msg;
    return nullptr;
  }
  if ((view_dims_num > 0 && (view_dims == nullptr || stride == nullptr)) ||
      storage_dims == nullptr || storage_dims_num == 0 || item_size(data_type) == 0) {
    g_error = "aclCreateTensor: bad arguments";
    return nullptr;
  }
  auto* t = new aclTensor;
  t->dims.assign(view_dims, view_dims + view_dims_num);
  t->strides.assign(stride, stride + view_dims_num);
  t->storage_dims.assign(storage_dims, storage_dims + storage_dims_num);
  t->offset = offset;
  t->dtype = data_type;
  t->format = format;
  t->data = tensor_data;
  g_tensors.insert(t);
  g_count["tensors_made"]++;
  return t;
}

EXPORT int aclDestroyTensor(const aclTensor* t) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_count["aclDestroyTensor"]++;
  g_log += "D ";
  if (t == nullptr) return kOk;
  if (g_tensors.erase(t) == 0) {
    g_count["bad_destroy"]++;  // double destroy or a pointer we never made
    return fail(kInvalid, "aclDestroyTensor: unknown tensor");
  }
  delete t;
  return kOk;
}

EXPORT int aclSetAclOpExecutorRepeatable(aclOpExecutor* e) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_executors.count(e) == 0) return fail(kInvalid, "aclSetAclOpExecutorRepeatable: unknown");
  e->repeatable = true;
  return kOk;
}

EXPORT int aclDestroyAclOpExecutor(aclOpExecutor* e) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_count["aclDestroyAclOpExecutor"]++;
  g_log += "X ";
  if (g_executors.count(e) == 0 || !e->repeatable) {
    g_count["bad_destroy"]++;
    return fail(kInvalid, "aclDestroyAclOpExecutor: unknown or non-repeatable executor");
  }
  g_executors.erase(e);
  delete e;
  return kOk;
}

EXPORT const char* aclGetRecentErrMsg() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_error.empty() ? nullptr : g_error.c_str();
}

// As libascendcl's: whether `stream` is being captured into an ACL graph.
EXPORT int aclmdlRICaptureGetInfo(void* stream, int* status, void** model) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_count["aclmdlRICaptureGetInfo"]++;
  if (stream == nullptr || status == nullptr) return kInvalid;
  *status = g_capture_status;
  if (model != nullptr) *model = nullptr;
  return kOk;
}

// ---- the op's two phases ---------------------------------------------------------------------

#ifndef FAKE_WITHOUT_OP
EXPORT int aclnnFusedGdnDecodeGetWorkspaceSize(
    const aclTensor* mixed, const aclTensor* a, const aclTensor* b, const aclTensor* a_log,
    const aclTensor* dt_bias, aclTensor* state, const aclTensor* idx, float scale,
    float threshold, aclTensor* out, uint64_t* workspace_size, aclOpExecutor** executor) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_count["GetWorkspaceSize"]++;
  g_log += "W ";
  const aclTensor* ts[8] = {mixed, a, b, a_log, dt_bias, state, idx, out};
  const char* names[8] = {"mixedQkv", "a", "b", "aLog", "dtBias", "stateRef", "ssmStateIndices",
                          "out"};
  for (int i = 0; i < 8; ++i) {
    if (ts[i] == nullptr) return fail(kNullptr, std::string(names[i]) + " is nullptr");
  }
  if (workspace_size == nullptr || executor == nullptr) {
    return fail(kNullptr, "workspaceSize or executor is nullptr");
  }
  if (g_fail_phase == 1) return fail(g_fail_status, g_fail_msg);
  const size_t ranks[8] = {2, 2, 2, 1, 1, 4, 1, 4};
  for (int i = 0; i < 8; ++i) {
    const std::string n = names[i];
    if (g_tensors.count(ts[i]) == 0) return fail(kInvalid, n + " is not a live aclTensor");
    if (ts[i]->format != kFormatNd) return fail(kInvalid, n + " must have format ND");
    if (ts[i]->dims.size() != ranks[i]) return fail(kInvalid, n + " has the wrong rank");
    std::string why;
    if (!view_fits(ts[i], &why)) return fail(kInvalid, n + ": " + why);
    if (!storage_live(ts[i])) return fail(kInvalid, n + ": storage is not a live allocation");
  }
  const int dt = mixed->dtype;
  if (dt != kBf16 && dt != kFloat16) return fail(kInvalid, "mixedQkv must be BF16 or FP16.");
  for (const aclTensor* t : {a, b, dt_bias, static_cast<const aclTensor*>(out)}) {
    if (t->dtype != dt) {
      return fail(kInvalid, std::string("mixedQkv, a, b, dtBias and out must have the same "
                                        "dtype; got ") + dtype_name(t->dtype) + " vs " +
                                dtype_name(dt));
    }
  }
  if (a_log->dtype != kFloat) return fail(kInvalid, "aLog must be FP32.");
  if (idx->dtype != kInt32) return fail(kInvalid, "ssmStateIndices must be INT32.");
  if (state->dtype != kFloat && state->dtype != dt) {
    return fail(kInvalid, "stateRef must be FP32 or have the same dtype as mixedQkv.");
  }
  if (!contiguous(state)) return fail(kInvalid, "stateRef must be contiguous.");
  const int64_t B = mixed->dims[0], W = mixed->dims[1], Hv = state->dims[1], V = state->dims[2],
                K = state->dims[3];
  if (K < 64 || K > 2032) return fail(kInvalid, "K out of range.");
  if (Hv * V >= W || (W - Hv * V) % (2 * K) != 0) {
    return fail(kInvalid, "mixedQkv last dimension is inconsistent with K, Hv and V.");
  }
  const int64_t H = (W - Hv * V) / (2 * K);
  if (Hv % H != 0) return fail(kInvalid, "Hv must be divisible by the derived H.");
  if (a->dims != std::vector<int64_t>{B, Hv} || b->dims != std::vector<int64_t>{B, Hv} ||
      a_log->dims != std::vector<int64_t>{Hv} || dt_bias->dims != std::vector<int64_t>{Hv} ||
      idx->dims != std::vector<int64_t>{B}) {
    return fail(kInvalid, "input shapes are inconsistent");
  }
  if (out->dims != std::vector<int64_t>{B, 1, Hv, V}) {
    return fail(kInvalid, "out must have shape [B, 1, HV, V].");
  }
  if (!std::isfinite(scale) || !std::isfinite(threshold)) {
    return fail(kInvalid, "scale and softplusThreshold must be finite");
  }
  auto* e = new aclOpExecutor;
  for (int i = 0; i < 8; ++i) e->t[i] = ts[i];
  e->scale = scale;
  e->threshold = threshold;
  e->workspace_size = g_workspace_size;
  g_executors.insert(e);
  g_count["executors_created"]++;
  *executor = e;
  *workspace_size = g_workspace_size;
  return kOk;
}

EXPORT int aclnnFusedGdnDecode(void* workspace, uint64_t workspace_size, aclOpExecutor* e,
                               void* stream) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_count["Launch"]++;
  g_log += "L ";
  g_last_stream = reinterpret_cast<uintptr_t>(stream);
  if (e == nullptr) return fail(kNullptr, "executor is nullptr");
  if (g_executors.count(e) == 0) {
    return fail(kInvalid, "executor was not made by GetWorkspaceSize or was already used");
  }
  // The second phase consumes a non-repeatable executor whatever happens next.
  const aclOpExecutor x = *e;
  if (!e->repeatable) {
    g_executors.erase(e);
    delete e;
    g_count["executors_consumed"]++;
  }
  if (g_fail_phase == 2) return fail(g_fail_status, g_fail_msg);
  if (workspace_size != x.workspace_size) {
    return fail(kInvalid, "workspaceSize differs from the one GetWorkspaceSize returned");
  }
  if (workspace_size > 0) {
    if (workspace == nullptr) return fail(kNullptr, "workspace is nullptr");
    if (g_live != nullptr && !g_live(workspace, workspace_size)) {
      return fail(kInvalid, "workspace is not a live device allocation");
    }
    std::memset(workspace, 0x5a, workspace_size);  // the kernel may scribble on all of it
  }
  for (const aclTensor* t : x.t) {
    if (g_tensors.count(t) == 0) return fail(kInvalid, "an input aclTensor was destroyed before launch");
    if (!storage_live(t)) return fail(kInvalid, "a tensor's storage was freed before launch");
  }
  compute(x);
  return kOk;
}
#endif

// ---- test controls (not part of any vendor API) ----------------------------------------------

EXPORT void fake_acl_reset() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_count.clear();
  g_log.clear();
  g_error.clear();
  g_last_stream = 0;
  g_workspace_size = 256;
  g_fail_phase = g_fail_status = 0;
  g_fail_msg.clear();
  g_capture_status = 0;
}

EXPORT int64_t fake_acl_counter(const char* name) {
  std::lock_guard<std::mutex> lock(g_mu);
  const std::string n = name;
  if (n == "live_tensors") return static_cast<int64_t>(g_tensors.size());
  if (n == "live_executors") return static_cast<int64_t>(g_executors.size());
  auto it = g_count.find(n);
  return it == g_count.end() ? 0 : it->second;
}

EXPORT const char* fake_acl_log() {
  return g_log.c_str();
}

EXPORT uintptr_t fake_acl_last_stream() {
  return g_last_stream;
}

EXPORT void fake_acl_set_workspace_size(uint64_t n) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_workspace_size = n;
}

// phase 1: GetWorkspaceSize, 2: the launch (returning `status`); 3: the `status`-th
// aclCreateTensor returns null; 0: no failure.
EXPORT void fake_acl_fail(int phase, int status, const char* msg) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_fail_phase = phase;
  g_fail_status = status;
  g_fail_msg = msg ? msg : "";
}

EXPORT void fake_acl_set_live_checker(void* fn) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_live = reinterpret_cast<LiveFn>(fn);
}

EXPORT void fake_acl_set_capture_status(int status) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_capture_status = status;
}
