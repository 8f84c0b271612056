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


def test_system_info_has_no_amx_and_cpu_backend():
    info = llamax.system_info()
    assert "CPU" in info
    assert "AMX_INT8 = 1" not in info  # AMX kernels die with SIGILL on these VMs


def test_package_ships_declarations():
    import importlib.resources as r
    names = {p.name for p in r.files("llamax").iterdir()}
    assert "_core.pxd" in names
    assert {"llama.pxd", "shim.pxd"} <= {p.name for p in r.files("llamax.includes").iterdir()}
