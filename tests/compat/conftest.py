"""llama-cpp-python's own tests, run against llamax.

llamax is imported under the name the tests use, ``llama_cpp`` (with its
submodules' names), exactly as a user switching by ``import llamax as
llama_cpp`` would.  With ``LLAMAX_COMPAT_PEER=1`` nothing is aliased and the
same files run against llama-cpp-python 0.3.36 itself (tools/compat/peer_tests.py
does that in the peer's venv, to know what it passes here).
"""
import os
import sys

if os.environ.get("LLAMAX_COMPAT_PEER") != "1":
    import llamax
    from llamax import grammar, llama_cache, llama_chat_format, llama_speculative, llama_tokenizer, llama_types

    for name, module in {
        "llama_cpp": llamax, "llama_cpp.llama_types": llama_types, "llama_cpp.llama_chat_format": llama_chat_format,
        "llama_cpp.llama_grammar": grammar, "llama_cpp.llama_cache": llama_cache,
        "llama_cpp.llama_speculative": llama_speculative, "llama_cpp.llama_tokenizer": llama_tokenizer,
    }.items():
        if name in sys.modules and sys.modules[name] is not module:
            raise RuntimeError(f"{name} is already imported from {sys.modules[name].__file__}: these tests must "
                               "run against llamax")
        sys.modules[name] = module


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
