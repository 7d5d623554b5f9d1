"""The CUDA backend of copy_blocks compiles, on a machine without a GPU.

CI has no GPU and its torch is the CPU build, so setup.py never builds
csrc/copy_blocks_cuda.cu there. Where nvcc is installed, this test compiles it
to an object file against the installed torch's headers (for sm_90, the H100 /
H200 the project is lent) and checks that the object holds all nine
(source, destination) dtype instantiations of the kernel (each with its vector
width) and the host entry
point the op registers. The CPU wheel lacks one generated header of c10's CUDA
part (`c10/cuda/impl/cuda_cmake_macros.h`); the test writes it (one define).
Running the kernel needs a GPU: tests/reshard/test_ops.py does that when CUDA
is present.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "copy_blocks_cuda.cu"
DTYPES = ("float", "c10::BFloat16", "c10::Half")


def _compile(tmp_path: Path) -> Path:
    import torch
    from torch.utils.cpp_extension import include_paths

    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    obj = tmp_path / "copy_blocks_cuda.o"
    cmd = [shutil.which("nvcc"), "-c", str(SOURCE), "-o", str(obj), "-O3", "-std=c++17",
           "-gencode", "arch=compute_90,code=sm_90", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           "-Xcudafe", "--diag_suppress=3306",  # torch headers: C++20 bit-field initialisers
           f"-I{tmp_path / 'stub'}", *(f"-I{p}" for p in include_paths())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return obj


def _demangled_symbols(obj: Path) -> list[str]:
    names = subprocess.run(["nm", "--format=posix", str(obj)], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return subprocess.run(["c++filt"], input="\n".join(line.split()[0] for line in names if line),
                          capture_output=True, text=True, check=True).stdout.splitlines()


@pytest.mark.skipif(any(shutil.which(t) is None for t in ("nvcc", "nm", "c++filt")),
                    reason="needs nvcc, nm and c++filt")
def test_cuda_kernel_source_compiles_with_every_dtype_pair(tmp_path) -> None:
    symbols = _demangled_symbols(_compile(tmp_path))
    kernels = {s.split("copy_blocks_kernel<", 1)[1].split(">(", 1)[0]
               for s in symbols if s.startswith("void hybrid_engine::(anonymous namespace)::"
                                                "copy_blocks_kernel<")}
    # <source, destination, V>: V elements per 16-byte vector of the wider dtype.
    size = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2}
    assert kernels == {f"{src}, {dst}, {16 // max(size[src], size[dst])}"
                       for src in DTYPES for dst in DTYPES}
    # The op's CUDA entry point (registered by TORCH_LIBRARY_IMPL) is defined here.
    assert any(s.startswith("hybrid_engine::copy_blocks_cuda(") for s in symbols)
