"""The extension is self-contained and built with the pinned llama.cpp."""
import subprocess
import sys

import pytest

import llamax
import llamax._core


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ldd is Linux's")
def test_no_shared_llama_library():
    out = subprocess.run(["ldd", llamax._core.__file__], capture_output=True, text=True).stdout
    assert "libllama" not in out and "libggml" not in out, out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ldd is Linux's")
def test_no_openmp():
    """ggml runs on its own per-context thread pools, not OpenMP: with
    OpenMP, a second thread running a graph (an embedding call beside a
    batcher, two contexts of a pool) puts every libgomp team of the process
    into non-spinning barriers once they outnumber the CPUs, for good
    (measured: 105 -> 35 tok/s; buildsys/build_llama_cpp.py)."""
    out = subprocess.run(["ldd", llamax._core.__file__], capture_output=True, text=True).stdout
    assert "libgomp" not in out and "libomp" not in out, out
    assert "OPENMP = 1" not in llamax.system_info()


def test_system_info_has_no_amx_and_cpu_backend():
    info = llamax.system_info()
    assert "CPU" in info
    assert "AMX_INT8 = 1" not in info  # AMX kernels die with SIGILL on these VMs


def test_package_ships_declarations():
    from importlib import resources
    names = {p.name for p in resources.files("llamax").iterdir()}
    assert "_core.pxd" in names
    assert {"llama.pxd", "shim.pxd"} <= {p.name for p in resources.files("llamax.includes").iterdir()}


# -- the CUDA build's configuration (buildsys/build_llama_cpp.py) ------------------
# Compiling ggml-cuda takes half an hour, so CI checks what the build script
# asks CMake for; tools/device_check.sh builds and runs it on a GPU.

def _build_script():
    from llamax_dev.buildsys import llama_build
    return llama_build


def _fake_cublas(root):
    (root / "include").mkdir(parents=True)
    (root / "lib").mkdir()
    for h in ("cublas.h", "cublas_api.h", "cublas_v2.h", "cublasLt.h", "cuda_runtime.h"):
        (root / "include" / h).write_text("/* a stand-in */\n")
    for lib in ("libcublas.so.13", "libcublasLt.so.13"):
        (root / "lib" / lib).write_bytes(b"")
    return root


def test_cuda_cmake_arguments(tmp_path, monkeypatch):
    b = _build_script()
    cub = _fake_cublas(tmp_path / "cublas")
    monkeypatch.setenv("LLAMAX_BACKEND", "cuda")
    monkeypatch.setenv("LLAMAX_CUBLAS_DIR", str(cub))
    monkeypatch.setenv("LLAMAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CMAKE_CUDA_ARCHITECTURES", raising=False)
    monkeypatch.setenv("LLAMAX_CUDA_ARCHS", "90-real,80-real")
    args = b.cmake_args()
    # no driver library linked: the build imports where there is no NVIDIA driver
    assert {"-DGGML_CUDA=ON", "-DGGML_CUDA_NO_VMM=ON", "-DGGML_OPENMP=OFF"} <= set(args)
    assert "-DCMAKE_CUDA_ARCHITECTURES=90-real;80-real" in args
    assert f"-DCUDA_cublas_LIBRARY={cub / 'lib' / 'libcublas.so.13'}" in args
    assert f"-DCUDA_cublasLt_LIBRARY={cub / 'lib' / 'libcublasLt.so.13'}" in args
    # cuBLAS's headers only: the wheels' shared include folder must not shadow the toolkit's
    flags = [a for a in args if a.startswith("-DCMAKE_CUDA_FLAGS=-isystem ")]
    assert len(flags) == 1
    inc = flags[0].split(" ", 1)[1]
    import os
    assert sorted(os.listdir(inc)) == ["cublas.h", "cublasLt.h", "cublas_api.h", "cublas_v2.h"]
    monkeypatch.delenv("LLAMAX_CUDA_ARCHS")
    assert f"-DCMAKE_CUDA_ARCHITECTURES={b.DEFAULT_CUDA_ARCHS}" in b.cmake_args()
    monkeypatch.setenv("CMAKE_CUDA_ARCHITECTURES", "89-real")
    assert "-DCMAKE_CUDA_ARCHITECTURES=89-real" in b.cmake_args()
    # a CPU build is untouched by all this
    monkeypatch.setenv("LLAMAX_BACKEND", "cpu")
    assert not [a for a in b.cmake_args() if "CUDA" in a]


def test_cuda_build_without_cublas_says_what_to_do(tmp_path, monkeypatch):
    b = _build_script()
    monkeypatch.setenv("LLAMAX_BACKEND", "cuda")
    monkeypatch.setenv("LLAMAX_CUBLAS_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="has no include/cublas_v2.h and lib/libcublas.so"):
        b.cmake_args()
    monkeypatch.setenv("LLAMAX_BACKEND", "rocm")
    with pytest.raises(RuntimeError, match="expected cpu, cuda or metal"):
        b.cmake_args()


def test_cuda_build_requirement_follows_nvcc(monkeypatch):
    """The build backend asks for the nvidia-cublas wheel matching nvcc's
    major version (CUDA 13: nvidia-cublas; 12: nvidia-cublas-cu12)."""
    b = _build_script()
    from llamax_dev.buildsys import load_backend
    backend = load_backend()
    monkeypatch.delenv("LLAMAX_CUBLAS_DIR", raising=False)
    monkeypatch.setenv("LLAMAX_BACKEND", "cpu")
    assert backend._extra() == []
    monkeypatch.setenv("LLAMAX_BACKEND", "cuda")
    major = b.cuda_major()
    nvcc = b._nvcc()
    if major is None:
        assert backend._extra() == []  # no toolkit: nothing to match (the build itself then says so)
    elif b._toolkit_has_cublas(nvcc):
        assert backend._extra() == []
    else:
        want = f"nvidia-cublas>={major},<{major + 1}" if major >= 13 else f"nvidia-cublas-cu{major}"
        assert backend._extra() == [want]


def test_cuda_build_cache_ignores_where_cublas_was_installed(tmp_path, monkeypatch):
    """pip's isolated build environments are temporary folders: the same
    cuBLAS from two of them must hit the same cached ggml-cuda build (an
    hour of compiling), and another arch must not."""
    b = _build_script()
    monkeypatch.setenv("LLAMAX_BACKEND", "cuda")
    monkeypatch.setenv("LLAMAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LLAMAX_CUDA_ARCHS", "90-real")
    dirs = []
    for env in ("pip-build-env-a", "pip-build-env-b"):
        monkeypatch.setenv("LLAMAX_CUBLAS_DIR", str(_fake_cublas(tmp_path / env / "nvidia" / "cu13")))
        dirs.append(b.build_dir())
    assert dirs[0] == dirs[1]
    monkeypatch.setenv("LLAMAX_CUDA_ARCHS", "80-real")
    assert b.build_dir() != dirs[0]
