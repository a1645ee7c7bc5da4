"""The NPU binding's hand-written ABI against the real torch-npu wheels (x86-64 and aarch64).

The binding links nothing from torch_npu or CANN: it looks functions up by mangled name and
declares the ACL types it passes itself (csrc/npu/torch_npu_abi.h, csrc/npu/acl_api.h). These
tests check those assumptions against what the wheel ships:
- every name the binding looks up is exported by libtorch_npu.so of both wheels;
- tests/abi/check_torch_npu_abi.cpp, compiled against the wheel's headers, finds every ACL enum
  value and function type of acl_api.h equal to the shipped one, NPUStream's declaration with the
  layout and return convention of our mirror, and the compiler's mangled names of the real
  declarations equal to the looked-up names;
- the same compile fails when one declared value, signature or layout is changed.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp_ext

import custom_ops  # noqa: F401  (registers custom_ops_npu.torch_npu_symbols)

REPO = Path(__file__).resolve().parent.parent
ABI_DIR = Path(__file__).resolve().parent / "abi"
ACL_API = REPO / "csrc" / "npu" / "acl_api.h"
OP_PLUGIN = "third_party/op-plugin/op_plugin/utils/op_api_common_base.h"
# acl_api.h function type -> the wheel's declaration of that function
SHIPPED_FUNCTIONS = {
    "aclCreateTensor": "::_aclCreateTensor",  # op-plugin's typedef
    "aclDestroyTensor": "::_aclDestroyTensor",
    "aclGetRecentErrMsg": "decltype(&::aclGetRecentErrMsg)",  # acl_rt.h
    "aclmdlRICaptureGetInfo": "decltype(&::aclmdlRICaptureGetInfo)",
    "aclnnFusedGdnDecode": "::OpApiFunc",  # the launch phase every aclnn op shares
}
# Declared by CANN's aclnn headers and the op package, which the wheel does not ship.
NOT_IN_WHEEL = {"aclnnFusedGdnDecodeGetWorkspaceSize", "aclSetAclOpExecutorRepeatable",
                "aclDestroyAclOpExecutor"}

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def exports(wheel, arch):
    return set((wheel / arch / "libtorch_npu.exports").read_text().split())


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_looked_up_symbols_are_exported(torch_npu_wheel, arch):
    names = torch.ops.custom_ops_npu.torch_npu_symbols()
    assert len(names) == 3
    assert set(names) <= exports(torch_npu_wheel, arch)


def check_source(wheel_include, acl_api_text):
    """The check translation unit with its generated part: op-plugin's typedefs copied from the
    wheel, a static_assert per enumerator and per function type of acl_api.h."""
    enumerators = re.findall(r"^\s*(ACL_[A-Z0-9_]+)\s*=", acl_api_text, re.MULTILINE)
    functions = re.findall(r"^using (\w+)Fn\s*=", acl_api_text, re.MULTILINE)
    assert set(functions) == set(SHIPPED_FUNCTIONS) | NOT_IN_WHEEL, (
        "classify each function type of acl_api.h in this test")
    op_plugin = (wheel_include / OP_PLUGIN).read_text()
    typedefs = re.findall(r"typedef struct (?:aclTensor|aclOpExecutor) \w+;", op_plugin)
    typedefs += re.findall(r"typedef \w+\* \(\*_aclCreateTensor\)\([^;]*\);", op_plugin)
    typedefs += re.findall(r"typedef int \(\*_aclDestroyTensor\)\([^;]*\);", op_plugin)
    typedefs += re.findall(r"using OpApiFunc = [^;]*;", op_plugin)
    assert len(typedefs) == 5, typedefs
    checks = [f'static_assert(ours::{e} == ::{e}, "{e}");' for e in enumerators]
    checks += [f"static_assert(std::is_same_v<abi_check::shipped_t<ours::{f}Fn>, "
               f'{SHIPPED_FUNCTIONS[f]}>, "{f}");' for f in functions if f in SHIPPED_FUNCTIONS]
    src = (ABI_DIR / "check_torch_npu_abi.cpp").read_text()
    return src.replace("@OP_PLUGIN_TYPEDEFS@", "\n".join(typedefs)) + "\n".join(checks) + "\n"


def compile_check(wheel, tmp_path, csrc, mode):
    """Starts the compile of the check against the wheel's headers; returns the Popen."""
    include = wheel / "x86_64" / "torch_npu" / "include"
    src = tmp_path / "check.cpp"
    src.write_text(check_source(include, (csrc / "npu" / "acl_api.h").read_text()))
    torch_inc = cpp_ext.include_paths()
    # C++20, as the extension (setup.py): torch 2.14's headers need it (std::strong_ordering).
    cmd = ["g++", "-std=c++20", mode, "-w", f"-I{ABI_DIR / 'shadow'}", f"-I{csrc}",
           f"-I{include}", *(f"-I{p}" for p in torch_inc), str(src), "-o",
           str(tmp_path / "check.o")]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_declarations_match_the_wheel_headers(torch_npu_wheel, tmp_path):
    from fetch_torch_npu import elf_symbols

    proc = compile_check(torch_npu_wheel, tmp_path, REPO / "csrc", "-c")
    _, err = proc.communicate()
    assert proc.returncode == 0, err[-4000:]
    _, undefined = elf_symbols((tmp_path / "check.o").read_bytes())
    # the real declarations mangle to exactly the names the binding looks up
    assert set(torch.ops.custom_ops_npu.torch_npu_symbols()) <= undefined


# what to change -> (file, old, new, the label of the static_assert that must fail)
MUTATIONS = {
    "enum value": ("npu/acl_api.h", "ACL_BF16 = 27", "ACL_BF16 = 28", "ACL_BF16"),
    "function signature": ("npu/acl_api.h", "uint64_t view_dims_num", "uint32_t view_dims_num",
                           "aclCreateTensor"),
    "NPUStream return convention": ("npu/torch_npu_abi.h", "  ~NpuStreamAbi() {}", "",
                                    "NPUStream destructor triviality"),
}


def test_check_fails_when_a_declaration_changes(torch_npu_wheel, tmp_path):
    """The check is not vacuous: one changed value, signature or layout breaks the compile (the
    three mutated copies compile side by side)."""
    procs = {}
    for i, (what, (rel, old, new, label)) in enumerate(MUTATIONS.items()):
        work = tmp_path / str(i)
        shutil.copytree(REPO / "csrc" / "npu", work / "csrc" / "npu")
        text = (work / "csrc" / rel).read_text()
        assert old in text, what
        (work / "csrc" / rel).write_text(text.replace(old, new))
        procs[what] = (compile_check(torch_npu_wheel, work, work / "csrc", "-fsyntax-only"), label)
    for what, (proc, label) in procs.items():
        _, err = proc.communicate()
        assert proc.returncode != 0, what
        assert label in err, f"{what}: {err[-4000:]}"


@pytest.mark.parametrize("probe_rc, listed, raised", [
    (1, "", "RegistryUnreachable"),  # pip reaches no index: the tests skip
    (0, "2.14.0, 2.13.0", "NoRelease"),  # no torch-npu for this torch: they skip outside CI
    (0, "2.15.0, 2.14.0", "RuntimeError"),  # listed but not downloaded: an error
])
def test_fetch_tells_a_missing_release_from_a_failure(monkeypatch, tmp_path, probe_rc, listed,
                                                      raised):
    """scripts/fetch_torch_npu.py with a labelled double for pip: a torch-npu download of 2.15.0
    that fails, and `pip index versions torch-npu` answering as given."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import fetch_torch_npu

    def fake_pip(*args):
        if args[0] == "download":
            return subprocess.CompletedProcess(args, 1, "", "ERROR: No matching distribution")
        assert args == ("index", "versions", "torch-npu"), args
        out = f"torch-npu ({listed.split(',')[0]})\nAvailable versions: {listed}\n" if listed else ""
        return subprocess.CompletedProcess(args, probe_rc, out, "" if listed else "ERROR: offline")

    monkeypatch.setattr(fetch_torch_npu, "_pip", fake_pip)
    with pytest.raises(RuntimeError) as e:
        fetch_torch_npu._download("2.15.0", "x86_64", tmp_path)
    assert type(e.value).__name__ == raised, e.value
    if raised == "NoRelease":
        assert str(e.value) == "torch-npu has no release 2.15.0 (its newest: 2.14.0, 2.13.0)"
    # The tests skip for an unreachable index always, for no release except in .ci/run's second
    # run (CUSTOM_OPS_REQUIRE_TORCH_NPU=1), for nothing else.
    for require, skips in (("", raised != "RuntimeError"), ("1", raised == "RegistryUnreachable")):
        environ = {"CUSTOM_OPS_REQUIRE_TORCH_NPU": require}
        assert fetch_torch_npu.may_skip(e.value, environ) == skips, (raised, require)
