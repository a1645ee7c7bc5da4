"""Benchmarks and device checks of custom_ops; run from the repository root, not installed.

    python -m benchmarks                  the main job: the CPU table (--device cpu|npu|cuda)
    python -m benchmarks.threads          concurrent Python callers on one slot pool (CPU)
    python -m benchmarks.hugepages        the op and rmw from DRAM on 4 KiB vs 2 MiB pages (CPU,
                                          Linux), interleaved
    python -m benchmarks.kernel_ab        CPU kernel sources (git revisions, directories) compiled
                                          side by side: same bits checked, then timed interleaved
    python -m benchmarks.gpu              the CUDA benchmark, target verdicts, tile sweep (GPU
                                          host; its checks: pytest tests/test_triton_device.py)
    python -m benchmarks.triton_compile   the Triton kernel compiled for sm_80/sm_90 without a GPU:
                                          registers and spills per configuration
    python -m benchmarks.npu_vs_cpu       the NPU binding against the CPU op (Ascend host)
    python -m benchmarks.transformers_decode  decode tokens/s of a Qwen3-Next-shaped transformers
                                          model, stock vs custom_ops.integrations.transformers
    python -m benchmarks.vllm_decode      the op against vLLM's CPU decode kernel, and vLLM's engine
                                          decode step with and without the plugin (vLLM venv)

``benchmarks.gpu`` holds the CUDA timing (Triton kernel, FLA, compiled reference, copy);
``benchmarks._harness`` the state bytes, slot rotation and timing loops every benchmark uses.
Inputs and tolerances come from ``custom_ops.testing``, as in the tests.
"""
