// dlopen/dlsym binding to CANN and torch_npu (see vendor_loader.h).
#include "npu/vendor_loader.h"

#include "npu/torch_npu_abi.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <sstream>
#include <vector>

#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "fused_gdn_decode.h"

namespace custom_ops::npu {
namespace {

constexpr const char* kGetWorkspaceSize = "aclnnFusedGdnDecodeGetWorkspaceSize";
constexpr const char* kLaunch = "aclnnFusedGdnDecode";
constexpr const char* kCustLib = "libcust_opapi.so";
// Built-in op API libraries, tried last by bare name (the loader's LD_LIBRARY_PATH search, which
// CANN's set_env.sh sets up). FusedGdnDecode is an op package today, so these normally lack it.
constexpr const char* kBuiltinLibs[] = {"libopapi_transformer.so", "libopapi.so"};
// Where the ACL tensor API lives when the op library does not bring it in as a dependency.
constexpr const char* kMetaLibs[] = {"libnnopbase.so", "libopapi.so"};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep)) {
    // trim blanks (config.ini lines may carry spaces or a '\r')
    const auto b = cur.find_first_not_of(" \t\r\n");
    const auto e = cur.find_last_not_of(" \t\r\n");
    if (b != std::string::npos) {
      parts.push_back(cur.substr(b, e - b + 1));
    }
  }
  return parts;
}

struct Candidate {
  std::string path;    // a file path, or a bare soname for the built-ins; "" for a note
  std::string origin;  // how it was found (or, for a note, why a place gave no candidate)
};

// The search order of docs/spec.md ("The vendor pieces (NPU path)") / op-plugin's
// GetOpApiFuncAddr. Places that yield no candidate at
// all (unset variables, unreadable config.ini) appear as notes, in order, for the error message.
std::vector<Candidate> candidates() {
  std::vector<Candidate> out;
  auto note = [&out](std::string text) { out.push_back({"", std::move(text)}); };
  const char* custom = std::getenv("ASCEND_CUSTOM_OPP_PATH");
  if (custom == nullptr || *custom == '\0') {
    note("ASCEND_CUSTOM_OPP_PATH is not set");
  } else {
    for (const auto& dir : split(custom, ':')) {
      out.push_back({dir + "/op_api/lib/" + kCustLib, "ASCEND_CUSTOM_OPP_PATH entry " + dir});
    }
  }
  const char* opp = std::getenv("ASCEND_OPP_PATH");
  if (opp == nullptr || *opp == '\0') {
    note("ASCEND_OPP_PATH is not set, so no vendors/config.ini was read");
  } else {
    const std::string config = std::string(opp) + "/vendors/config.ini";
    std::ifstream in(config);
    if (!in) {
      note(config + ": cannot be read");
    } else {
      std::string line;
      bool found = false;
      while (std::getline(in, line)) {
        const std::string key = "load_priority=";
        if (line.compare(0, key.size(), key) == 0) {
          found = true;
          for (const auto& name : split(line.substr(key.size()), ',')) {
            out.push_back({std::string(opp) + "/vendors/" + name + "/op_api/lib/" + kCustLib,
                           config + " vendor " + name});
          }
          break;
        }
      }
      if (!found) {
        note(config + ": no load_priority= line");
      }
    }
  }
  for (const char* lib : kBuiltinLibs) {
    out.push_back({lib, "built-in op API (dlopen by name)"});
  }
  return out;
}

std::string dl_error() {
  const char* e = dlerror();
  return e ? e : "unknown dlopen error";
}

// Like op-plugin, refuse a library someone else could have planted: it must belong to root or to
// the current user. Returns "" when acceptable, else the reason.
std::string owner_problem(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    return "no such file";
  }
  const uid_t me = geteuid();
  if (st.st_uid != 0 && st.st_uid != me) {
    return "owned by uid " + std::to_string(st.st_uid) + ", neither root nor the current user (uid " +
           std::to_string(me) + "); not loaded";
  }
  return "";
}

template <typename Fn>
Fn symbol(void* handle, const char* name) {
  return reinterpret_cast<Fn>(dlsym(handle, name));
}

std::shared_ptr<const VendorApi> load() {
  std::vector<std::string> tried;
  auto api = std::make_shared<VendorApi>();
  void* op_handle = nullptr;
  for (const auto& c : candidates()) {
    if (c.path.empty()) {
      tried.push_back(c.origin);
      continue;
    }
    const bool is_path = c.path.find('/') != std::string::npos;
    if (is_path) {
      const std::string problem = owner_problem(c.path);
      if (!problem.empty()) {
        tried.push_back(c.path + " (" + c.origin + "): " + problem);
        continue;
      }
    }
    void* h = dlopen(c.path.c_str(), RTLD_LAZY | RTLD_LOCAL);
    if (h == nullptr) {
      tried.push_back(c.path + " (" + c.origin + "): " + dl_error());
      continue;
    }
    auto ws = symbol<aclnnFusedGdnDecodeGetWorkspaceSizeFn>(h, kGetWorkspaceSize);
    auto launch = symbol<aclnnFusedGdnDecodeFn>(h, kLaunch);
    if (ws == nullptr || launch == nullptr) {
      tried.push_back(c.path + " (" + c.origin + "): loaded, but does not export " +
                      (ws == nullptr ? kGetWorkspaceSize : kLaunch));
      continue;  // keep it loaded: dlclose of vendor libraries is not always safe
    }
    api->op_library = c.path;
    api->get_workspace_size = ws;
    api->launch = launch;
    op_handle = h;
    break;
  }
  if (op_handle == nullptr) {
    std::ostringstream msg;
    msg << kOp << "the vendor operator aclnnFusedGdnDecode was not found (needed symbols "
        << kGetWorkspaceSize << " and " << kLaunch << "). Searched, in order:";
    int i = 1;
    for (const auto& t : tried) {
      msg << "\n  " << i++ << ". " << t;
    }
    msg << "\nInstall the FusedGdnDecode custom op package (CANN ops-transformer, experimental/"
           "attention/fused_gdn_decode) and source its set_env.bash so that ASCEND_CUSTOM_OPP_PATH "
           "names it, or register it in $ASCEND_OPP_PATH/vendors/config.ini.";
    TORCH_CHECK(false, msg.str());
  }

  // The ACL tensor API: first from the op library itself or its dependencies (dlsym on a handle
  // searches its whole dependency tree; a real libcust_opapi.so links libnnopbase.so), then from
  // the libraries that define it.
  api->create_tensor = symbol<aclCreateTensorFn>(op_handle, "aclCreateTensor");
  api->destroy_tensor = symbol<aclDestroyTensorFn>(op_handle, "aclDestroyTensor");
  void* meta_handle = op_handle;
  api->meta_library = api->op_library;
  std::vector<std::string> meta_tried{api->op_library + ": no aclCreateTensor/aclDestroyTensor"};
  for (const char* lib : kMetaLibs) {
    if (api->create_tensor != nullptr && api->destroy_tensor != nullptr) {
      break;
    }
    void* h = dlopen(lib, RTLD_LAZY | RTLD_LOCAL);
    if (h == nullptr) {
      meta_tried.push_back(std::string(lib) + ": " + dl_error());
      continue;
    }
    api->create_tensor = symbol<aclCreateTensorFn>(h, "aclCreateTensor");
    api->destroy_tensor = symbol<aclDestroyTensorFn>(h, "aclDestroyTensor");
    meta_handle = h;
    api->meta_library = lib;
    if (api->create_tensor == nullptr || api->destroy_tensor == nullptr) {
      meta_tried.push_back(std::string(lib) + ": no aclCreateTensor/aclDestroyTensor");
    }
  }
  if (api->create_tensor == nullptr || api->destroy_tensor == nullptr) {
    std::ostringstream msg;
    msg << kOp << "found " << kLaunch << " in " << api->op_library
        << " but not the ACL tensor API (aclCreateTensor, aclDestroyTensor). Searched:";
    for (const auto& t : meta_tried) {
      msg << "\n  " << t;
    }
    msg << "\nSource CANN's set_env.sh so that libnnopbase.so is on LD_LIBRARY_PATH.";
    TORCH_CHECK(false, msg.str());
  }
  api->set_executor_repeatable =
      symbol<aclSetAclOpExecutorRepeatableFn>(meta_handle, "aclSetAclOpExecutorRepeatable");
  api->destroy_executor = symbol<aclDestroyAclOpExecutorFn>(meta_handle, "aclDestroyAclOpExecutor");

  // Error text lives in libascendcl.so, which torch_npu has loaded; never load it just for this.
  api->recent_error = symbol<aclGetRecentErrMsgFn>(op_handle, "aclGetRecentErrMsg");
  if (api->recent_error == nullptr) {
    if (void* h = dlopen("libascendcl.so", RTLD_LAZY | RTLD_NOLOAD)) {
      api->recent_error = symbol<aclGetRecentErrMsgFn>(h, "aclGetRecentErrMsg");
    }
  }
  // Capture status, from the op library's dependencies or the libascendcl.so torch_npu loaded.
  api->capture_info = symbol<aclmdlRICaptureGetInfoFn>(op_handle, "aclmdlRICaptureGetInfo");
  if (api->capture_info == nullptr) {
    if (void* h = dlopen("libascendcl.so", RTLD_LAZY | RTLD_NOLOAD)) {
      api->capture_info = symbol<aclmdlRICaptureGetInfoFn>(h, "aclmdlRICaptureGetInfo");
    }
  }
  dlerror();  // clear any pending error left by the optional lookups
  return api;
}

// ---------------------------------------------------------------------------------------------
// The current aclrtStream.
//
// torch_npu's PrivateUse1 guard returns a c10::Stream whose id is an encoded stream index, not
// the aclrtStream, and it does not implement getStreamNativeHandle. So, in order:
//  1. torch_npu's exported C++ API, found in the already-loaded libtorch_npu.so (never loaded by
//     us): c10_npu::getCurrentNPUStream(DeviceIndex) and NPUStream::stream(bool need_empty).
//     need_empty=true flushes torch_npu's task queue first, so every op queued before us has been
//     submitted to the stream before our kernel is (we launch directly, not through that queue).
//  2. The PrivateUse1 guard's getStreamNativeHandle, for backends that implement it.
// CUSTOM_OPS_TORCH_NPU_LIB overrides the library name/path looked up in 1 (tests use it).

struct StreamProvider {
  GetCurrentNpuStreamFn get_current = nullptr;
  NpuStreamStreamFn stream = nullptr;
  GetNpuFormatFn get_format = nullptr;  // torch_npu's storage-format query; absent elsewhere
  std::string where;  // description for describe_vendor()
  std::string format_where;
};

std::shared_ptr<const StreamProvider> find_stream_provider() {
  auto p = std::make_shared<StreamProvider>();
  const char* env = std::getenv("CUSTOM_OPS_TORCH_NPU_LIB");
  const std::string lib = (env != nullptr && *env != '\0') ? env : "libtorch_npu.so";
  // Only an already-loaded library: `import torch_npu` loads it (possibly RTLD_LOCAL, which is
  // why RTLD_DEFAULT alone is not enough).
  void* handles[] = {dlopen(lib.c_str(), RTLD_LAZY | RTLD_NOLOAD), RTLD_DEFAULT};
  for (void* h : handles) {
    if (h == nullptr) {
      continue;
    }
    auto get = symbol<GetCurrentNpuStreamFn>(h, kGetCurrentNpuStream);
    auto str = symbol<NpuStreamStreamFn>(h, kNpuStreamStream);
    if (get != nullptr && str != nullptr) {
      const std::string from = h == RTLD_DEFAULT ? std::string("the global symbol scope") : lib;
      p->get_current = get;
      p->stream = str;
      p->where = "c10_npu::getCurrentNPUStream(...).stream(true) from " + from;
      p->get_format = symbol<GetNpuFormatFn>(h, kGetNpuFormat);
      p->format_where = p->get_format ? "at_npu::native::get_npu_format from " + from
                                      : "not checked (" + from + " has no get_npu_format)";
      dlerror();
      return p;
    }
  }
  dlerror();
  p->format_where = "not checked (torch_npu's get_npu_format is not loaded)";
  p->where = "the PrivateUse1 device guard's getStreamNativeHandle (" + lib +
             " with c10_npu::getCurrentNPUStream is not loaded)";
  return p;
}

std::mutex g_mutex;
std::shared_ptr<const VendorApi> g_api;
std::shared_ptr<const StreamProvider> g_stream;

std::shared_ptr<const StreamProvider> stream_provider() {
  std::lock_guard<std::mutex> lock(g_mutex);
  // Only finding torch_npu's API is final: torch_npu may be imported after a first look (e.g. a
  // vendor_info() call), so the fallback is looked at again each time.
  if (!g_stream || g_stream->get_current == nullptr) {
    g_stream = find_stream_provider();
  }
  return g_stream;
}

} // namespace

std::shared_ptr<const VendorApi> vendor_api() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_api) {
    g_api = load();  // a failed search is not cached: the next call searches again
  }
  return g_api;
}

void reset_vendor_api() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_api.reset();
  g_stream.reset();
}

std::string recent_vendor_error(const VendorApi& api) {
  if (api.recent_error == nullptr) {
    return "";
  }
  const char* msg = api.recent_error();
  return msg ? msg : "";
}

aclrtStream current_acl_stream(const c10::Device& device) {
  const auto provider = stream_provider();
  if (provider->get_current != nullptr) {
    const NpuStreamAbi s = provider->get_current(device.index());
    aclrtStream stream = provider->stream(&s, /*need_empty=*/true);
    // torch_npu returns null when flushing its task queue failed; launching on a null stream
    // would run on ACL's default stream, unordered with the caller's work.
    TORCH_CHECK(stream != nullptr, kOp, "c10_npu::NPUStream::stream(need_empty=true) returned a "
                "null aclrtStream for stream ", s.stream.id(), " on ", device,
                " (torch_npu could not flush its task queue; its own error is logged above); "
                "nothing was launched");
    return stream;
  }
  const c10::impl::VirtualGuardImpl guard(device.type());
  const c10::Stream s = guard.getStream(device);
  void* stream = nullptr;
  try {
    stream = guard.getStreamNativeHandle(s);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, kOp, "cannot get the aclrtStream of the current stream of ", device,
                ": torch_npu's c10_npu::getCurrentNPUStream was not found (is torch_npu imported?) "
                "and the ", device.type(), " backend does not give native stream handles (",
                e.msg(), ")");
  }
  TORCH_CHECK(stream != nullptr, kOp, "the ", device.type(), " device guard's "
              "getStreamNativeHandle returned a null stream for ", s, "; nothing was launched");
  return stream;
}

std::optional<int64_t> torch_npu_storage_format(const at::Tensor& t) {
  const auto provider = stream_provider();
  if (provider->get_format == nullptr) {
    return std::nullopt;
  }
  return provider->get_format(t);
}

bool stream_is_capturing(const VendorApi& api, aclrtStream stream) {
  if (api.capture_info == nullptr) {
    return false;
  }
  aclmdlRICaptureStatus status = ACL_MODEL_RI_CAPTURE_STATUS_NONE;
  aclmdlRI model = nullptr;
  if (api.capture_info(stream, &status, &model) != 0) {
    return false;  // a stream ACL cannot describe is not being captured
  }
  return status != ACL_MODEL_RI_CAPTURE_STATUS_NONE;
}

std::vector<std::string> torch_npu_symbols() {
  return {std::begin(kTorchNpuSymbols), std::end(kTorchNpuSymbols)};
}

std::string describe_vendor() {
  std::ostringstream out;
  try {
    const auto api = vendor_api();
    out << "op library: " << api->op_library << "\n";
    out << "ACL tensor API: " << api->meta_library << "\n";
    out << "aclGetRecentErrMsg: " << (api->recent_error ? "available" : "not available") << "\n";
  } catch (const c10::Error& e) {
    out << "error: " << e.msg() << "\n";
  }
  out << "stream: " << stream_provider()->where << "\n";
  out << "storage format: " << stream_provider()->format_where << "\n";
  return out.str();
}

} // namespace custom_ops::npu
