"""Benchmarks and device checks of custom_ops; run from the repository root, not installed.

    python -m benchmarks                  the main job: the CPU table (--device cpu|npu|cuda)
    python -m benchmarks.threads          concurrent Python callers on one slot pool (CPU)
    python -m benchmarks.gpu              the CUDA benchmark, target verdicts, tile sweep (GPU
                                          host; its checks: pytest tests/test_triton_device.py)
    python -m benchmarks.triton_compile   the Triton kernel compiled for sm_80/sm_90 without a GPU:
                                          registers and spills per configuration
    python -m benchmarks.npu_vs_cpu       the NPU binding against the CPU op (Ascend host)
    python -m benchmarks.transformers_decode  decode tokens/s of a Qwen3-Next-shaped transformers
                                          model, stock vs custom_ops.integrations.transformers

``benchmarks.gpu`` holds the CUDA timing (Triton kernel, FLA, compiled reference, copy);
``benchmarks._harness`` the state bytes, slot rotation and timing loops every benchmark uses.
Inputs and tolerances come from ``custom_ops.testing``, as in the tests.
"""
