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
    (measured: 105 -> 35 tok/s; third_party/build_llama_cpp.py)."""
    out = subprocess.run(["ldd", llamax._core.__file__], capture_output=True, text=True).stdout
    assert "libgomp" not in out and "libomp" not in out, out
    assert "OPENMP = 1" not in llamax.system_info()


def test_system_info_has_no_amx_and_cpu_backend():
    info = llamax.system_info()
    assert "CPU" in info
    assert "AMX_INT8 = 1" not in info  # AMX kernels die with SIGILL on these VMs


def test_package_ships_declarations():
    import importlib.resources as r
    names = {p.name for p in r.files("llamax").iterdir()}
    assert "_core.pxd" in names
    assert {"llama.pxd", "shim.pxd"} <= {p.name for p in r.files("llamax.includes").iterdir()}
