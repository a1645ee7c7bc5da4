#!/usr/bin/env bash
# Builds custom_ops with AddressSanitizer + UndefinedBehaviorSanitizer (CUSTOM_OPS_SANITIZE=1) in a
# scratch copy of this checkout, so the normal in-place build is left alone, and runs the kernel,
# validation, index, autograd, fuzz, concurrency and long-decode tests against it (SANITIZE_TESTS
# overrides).
# Exits non-zero on a test failure or any sanitizer report.
#
#   bash scripts/run_sanitizers.sh [extra pytest args]     (PYTHON=... to pick the interpreter)
#
# The interpreter and torch are not instrumented, so the ASan runtime is preloaded ahead of them;
# leak checking is off because CPython keeps memory alive on purpose until exit.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
CXX=${CXX:-c++}
TESTS=${SANITIZE_TESTS:-"tests/test_correctness.py tests/test_validation.py tests/test_indices.py tests/test_autograd.py tests/test_fuzz.py tests/test_concurrency.py tests/test_long_decode.py"}
work=$(mktemp -d "${TMPDIR:-/tmp}/custom_ops_san.XXXXXX")
logs="$work/sanitizer-logs"
mkdir -p "$logs"
echo "run_sanitizers: building in $work"

# Tracked and untracked-but-not-ignored files: the tree as it is now, without build outputs.
git ls-files -z -c -o --exclude-standard | xargs -0 cp --parents -t "$work"
(cd "$work" && CUSTOM_OPS_SANITIZE=1 MAX_JOBS=${MAX_JOBS:-1} "$PYTHON" setup.py build_ext --inplace \
  > "$work/build.log" 2>&1) || { tail -30 "$work/build.log"; echo "run_sanitizers: build failed"; exit 2; }

asan=$("$CXX" -print-file-name=libasan.so)
ubsan=$("$CXX" -print-file-name=libubsan.so)
if [ ! -e "$asan" ] || [ ! -e "$ubsan" ]; then
  echo "run_sanitizers: libasan/libubsan not found next to $CXX" >&2
  exit 2
fi
# Reports go to files as well as stderr, so that one in a worker thread or a swallowed exit still
# fails the run.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:detect_stack_use_after_return=1:strict_string_checks=1:log_path=$logs/asan"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan"
(cd "$work" && LD_PRELOAD="$asan $ubsan" PYTHONPATH="$work" "$PYTHON" -c \
  "import custom_ops, sys; print('sanitized build:', custom_ops._C.__file__, custom_ops.cpu_isas())" &&
  LD_PRELOAD="$asan $ubsan" PYTHONPATH="$work" "$PYTHON" -m pytest -q -p no:cacheprovider $TESTS "$@")
rc=$?

if compgen -G "$logs/*" > /dev/null; then
  echo "run_sanitizers: sanitizer reports:" >&2
  cat "$logs"/* >&2
  [ "$rc" = 0 ] && rc=1
fi
echo "run_sanitizers: pytest exit $rc; scratch tree $work"
[ "$rc" = 0 ] && rm -rf "$work"
exit "$rc"
