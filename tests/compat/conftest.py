"""llama-cpp-python's own tests, run against llamax.

llamax is imported under the name the tests use, ``llama_cpp`` (with its
submodules' names), by ``llamax.as_llama_cpp.install()``, as a user whose
libraries import ``llama_cpp`` would.  With ``LLAMAX_COMPAT_PEER=1`` nothing is aliased and the
same files run against llama-cpp-python 0.3.36 itself (tools/compat/peer_tests.py
does that in the peer's venv, to know what it passes here).
"""
import os

if os.environ.get("LLAMAX_COMPAT_PEER") != "1":
    # (the documented way, llamax.as_llama_cpp: it refuses where the real
    # llama_cpp is imported or installed, so these tests run against llamax)
    import llamax.as_llama_cpp

    llamax.as_llama_cpp.install()


def pytest_collection_modifyitems(config, items):
    # llama-cpp-python's tests ask for n_threads=multiprocessing.cpu_count():
    # where a container or taskset leaves this process fewer cores than that,
    # llamax warns (OversubscriptionWarning), which this suite's warnings-as-
    # errors would turn into failures of tests written for another library.
    if os.environ.get("LLAMAX_COMPAT_PEER") == "1":
        return
    import pytest
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.filterwarnings("ignore::llamax.OversubscriptionWarning"))
