#!/usr/bin/env bash
# Builds a custom_ops wheel against the installed torch and installs it.
#
#   bash build_and_install.sh                    # build + install
#   bash build_and_install.sh --with-test-deps   # also install what the tests need
#
# torch is never replaced: the extension must match the torch it runs with. Only when torch is
# missing is torch==$TORCH_VERSION installed, from TORCH_INDEX_URL when set (PyPI's x86-64 Linux
# wheel is the CUDA build; https://download.pytorch.org/whl/cpu has the CPU one). On an Ascend
# host, install torch_npu and CANN first and source CANN's set_env.sh (docs/npu.md, "Prerequisites
# on the Ascend host"); the build is the same.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
WITH_TEST_DEPS=0
for arg in "$@"; do
  case "$arg" in
    --with-test-deps) WITH_TEST_DEPS=1 ;;
    *) echo "usage: bash build_and_install.sh [--with-test-deps]" >&2; exit 2 ;;
  esac
done

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "build_and_install: torch not found, installing torch==$TORCH_VERSION"
  "$PYTHON" -m pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$TORCH_VERSION"
fi
"$PYTHON" -m pip install -q "setuptools>=64" wheel ninja

rm -rf build dist custom_ops.egg-info custom_ops/_C*.so
MAX_JOBS=${MAX_JOBS:-2} "$PYTHON" -m pip wheel --no-build-isolation --no-deps -w dist .
"$PYTHON" -m pip install --no-deps --force-reinstall dist/custom_ops-*.whl
# Commands run from the checkout import the package directory here rather than the installed
# copy; give it the same freshly built extension.
cp build/lib*/custom_ops/_C*.so custom_ops/

if [ "$WITH_TEST_DEPS" = 1 ]; then
  "$PYTHON" -m pip install -q -r requirements-test.txt
  # The Triton kernel's tests run it through Triton's CPU interpreter. --no-deps: triton must never
  # bring another torch.
  if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
    "$PYTHON" -m pip install -q --no-deps "triton==${TRITON_VERSION:-3.9.0}"
    # FLA's Triton kernels, which the tests compare with ours through the interpreter in a process
    # of their own (tests/test_triton_device.py): into .cache/fla, not this environment, where
    # transformers' Qwen3-Next would take FLA's kernels, which need a GPU. Offline, that test skips.
    "$PYTHON" -m pip install -q --no-deps --upgrade --target .cache/fla "fla-core==0.6.0" einops \
      || echo "build_and_install: fla-core not fetched"
  fi
  # The torch-npu wheels (torchair's Python, headers, libtorch_npu.so's symbols) for the graph-mode
  # and ABI tests: downloaded once into .cache/torch_npu/, never installed. Offline, those tests
  # skip.
  "$PYTHON" scripts/fetch_torch_npu.py || echo "build_and_install: torch-npu wheels not fetched"
fi
"$PYTHON" -c "import custom_ops, torch; print('custom_ops installed: torch', torch.__version__, '| CPU kernel:', custom_ops.cpu_isa(), '| variants:', custom_ops.cpu_isas(), '| kernel threads:', 'intra-op (torch.set_num_threads)' if torch.ops.custom_ops_internal.cpu_threaded() else 'one (built without OpenMP: docs/building.md#compilers)')"
