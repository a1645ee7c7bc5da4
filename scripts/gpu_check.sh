#!/usr/bin/env bash
# The GPU checks of docs/gpu.md ("On a GPU") in one run, for a host with a CUDA GPU and a CUDA
# torch already installed: builds the extension in place, runs the compiled kernel's tests, the
# interpreter's tests in a process of their own, and the CUDA benchmark. Each step's output goes
# to OUT_DIR (default gpu-check/), with the commit and the machine; it goes on after a failed step
# and exits non-zero if any failed.
#
#   bash scripts/gpu_check.sh [OUT_DIR]
#
# PYTHON picks the interpreter; FLA_WHEEL=path/fla_core-*.whl installs fla-core (without its
# dependency einops) for the FLA comparisons first; GPU_CHECK_BENCH=0 skips the benchmark (a few
# minutes).
#
# The extension is built with CXX, default /usr/bin/g++ where it exists: a compiler other than
# the one whose C++ runtime torch loads can put its own copy of libstdc++'s stream code into
# _C.so, which crashed the first error message that formats a number (docs/gpu.md). A probe of
# such a message checks the build before the tests run.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
out=${1:-gpu-check}
mkdir -p "$out"
failed=()

step() {  # step NAME COMMAND...: runs COMMAND, its output to $out/NAME.log
  local name=$1
  shift
  echo "== $name: $*"
  if "$@" > "$out/$name.log" 2>&1; then
    echo "   ok ($out/$name.log)"
  else
    echo "   FAILED, exit $? ($out/$name.log):"
    tail -n 15 "$out/$name.log" | sed 's/^/   | /'
    failed+=("$name")
  fi
}

{
  git log --oneline -1 2>/dev/null || echo "(no git)"
  date -u
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not found"
  "$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA devices', torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
  "$PYTHON" -c "import triton; print('triton', triton.__version__)" 2>&1
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here; the CPU checks are the README's test command" >&2
  exit 2
fi

if [ -n "${FLA_WHEEL:-}" ]; then
  step fla "$PYTHON" -m pip install --no-deps "$FLA_WHEEL"
fi

build_env=()
if [ -n "${CXX:-}" ]; then
  build_env=(CXX="$CXX" LDSHARED="$CXX -shared")
elif [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then
  build_env=(CXX=/usr/bin/g++ CC=/usr/bin/gcc LDSHARED="/usr/bin/g++ -shared")
fi
step build env "${build_env[@]}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PYTHON" setup.py build_ext --inplace
step probe "$PYTHON" -c "
import torch, custom_ops
try:
    torch.ops.custom_ops_internal.check_slot_indices(torch.tensor([5], dtype=torch.int32), 2)
except ValueError as e:
    print('a message that formats numbers:', e)
else:
    raise SystemExit('the slot check accepted an index past BlockNum')
"

# Compiled: conftest.py leaves Triton's interpreter off where CUDA is.
step tests-compiled env -u TRITON_INTERPRET "$PYTHON" -m pytest -q -rfs -p no:cacheprovider \
  tests/test_triton_device.py tests/test_backends.py tests/test_strided_pool_out.py \
  tests/test_validation.py
# The Triton kernel on CPU tensors needs a process whose triton was imported interpreting.
step tests-interpreter env TRITON_INTERPRET=1 "$PYTHON" -m pytest -q -rfs -p no:cacheprovider \
  tests/test_triton_interpret.py tests/test_backends.py tests/test_strided_pool_out.py

if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
  step bench env PYTHONUNBUFFERED=1 "$PYTHON" -m benchmarks --device cuda --state-dtype fp32 bf16 \
    --batch 1 64 128 256 --no-progress
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: failed: ${failed[*]}" >&2
  exit 1
fi
echo "gpu_check: all steps passed; logs in $out/"
