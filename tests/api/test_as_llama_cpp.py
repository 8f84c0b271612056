"""``import llama_cpp`` meaning llamax for every module of a process
(llamax.as_llama_cpp): in code and through ``python -m llamax as-llama-cpp``,
third-party modules included, never hiding an installed llama-cpp-python
silently.  Each case runs in a fresh interpreter (the alias is per process).

The "installed llama-cpp-python" of the conflict cases is a package folder
named ``llama_cpp`` put on the path (what an installed distribution is to
the import system); llama-cpp-python itself is not installed here.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import llamax
from llamax import as_llama_cpp


def run(code: str, *args: str, path: list | None = None, cwd=None, module: bool = False) -> subprocess.CompletedProcess:
    """Python with ``code`` (or ``-m llamax ...args`` when module) in a fresh process."""
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "llamax", *args] if module else [sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


@pytest.fixture
def third_party(tmp_path):
    """A library that imports llama_cpp itself, as LangChain's does."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "someone_elses_lib.py").write_text(textwrap.dedent("""
        from llama_cpp import Llama
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter
        import llama_cpp.llama_types as llama_types

        def load(path):
            return Llama(model_path=path, vocab_only=True, verbose=False)
    """))
    return lib


@pytest.fixture
def peer(tmp_path):
    """A folder where ``import llama_cpp`` finds another package."""
    site = tmp_path / "site"
    (site / "llama_cpp").mkdir(parents=True)
    (site / "llama_cpp" / "__init__.py").write_text("WHO = 'the other llama_cpp'\n")
    return site


def test_install_makes_every_module_see_llamax(third_party, smollm2_path):
    r = run(f"""
        import sys, llamax, llamax.as_llama_cpp as alias
        alias.install()
        alias.install()   # (again: nothing more)
        import someone_elses_lib, llama_cpp
        import llama_cpp.llama_grammar, llama_cpp.llama_cache, llama_cpp.llama_speculative
        import llama_cpp.llama_tokenizer, llama_cpp.llama, llama_cpp.llama_cpp
        assert llama_cpp is llamax and someone_elses_lib.Llama is llamax.Llama
        for name, target in alias.MODULES.items():
            assert sys.modules[name] is sys.modules[target], name
        from llama_cpp.llama_grammar import LlamaGrammar
        assert LlamaGrammar is llamax.LlamaGrammar
        llm = someone_elses_lib.load({str(smollm2_path)!r})
        # the low-level API at llama_cpp.* too, as llama-cpp-python re-exports it (outlines' way to the vocabulary)
        assert llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model)) == llm.n_vocab()
        print(type(llm).__module__, llm.tokenize(b"Hello"))
    """, path=[third_party])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("llamax.llama [")


@pytest.mark.parametrize("name, says", [
    ("llama_cpp.server", "python -m llamax serve"),
    ("llama_cpp.mtmd_cpp", "mtmd"),
    ("llama_cpp.engine", "offers llama_cpp,"),     # a llamax file is never imported twice under another name
    ("llama_cpp._sgemm", "offers llama_cpp,"),
])
def test_what_it_does_not_offer_is_refused_by_name(name, says):
    r = run(f"""
        import sys, llamax.as_llama_cpp as alias
        alias.install()
        try:
            __import__({name!r})
        except ModuleNotFoundError as e:
            assert e.name == {name!r}
            print(e)
        assert not any(m.startswith("llama_cpp.") and m not in alias.MODULES for m in sys.modules)
    """)
    assert r.returncode == 0, r.stderr
    assert says in r.stdout and name in r.stdout


def test_uninstall_gives_the_name_back(peer):
    r = run("""
        import llamax.as_llama_cpp as alias
        alias.install(replace=True)
        import llama_cpp, llamax
        assert llama_cpp is llamax and alias.installed()
        alias.uninstall()
        assert not alias.installed()
        import llama_cpp
        print(llama_cpp.WHO)
    """, path=[peer])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "the other llama_cpp"


def test_an_installed_llama_cpp_is_not_hidden_silently(peer):
    r = run("""
        import llamax, llamax.as_llama_cpp as alias
        try:
            alias.install()
        except llamax.ShadowingError as e:
            assert isinstance(e, ImportError)
            print("refused:", e)
        import llama_cpp
        print(llama_cpp.WHO)
    """, path=[peer])
    assert r.returncode == 0, r.stderr
    refused, who = r.stdout.strip().splitlines()
    assert str(peer / "llama_cpp") in refused and "replace=True" in refused
    assert who == "the other llama_cpp"   # untouched
    # replace=True: llamax wins, with a warning that names what it hides
    r = run("""
        import warnings, llamax, llamax.as_llama_cpp as alias
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            alias.install(replace=True)
        assert len(w) == 1 and w[0].category is UserWarning, w
        print(w[0].message)
        import llama_cpp
        assert llama_cpp is llamax
    """, path=[peer])
    assert r.returncode == 0, r.stderr
    assert str(peer / "llama_cpp") in r.stdout and "uninstall()" in r.stdout


def test_a_llama_cpp_imported_already_is_refused_even_with_replace(peer):
    r = run("""
        import llama_cpp, llamax, llamax.as_llama_cpp as alias
        try:
            alias.install(replace=True)
        except llamax.ShadowingError as e:
            print(e)
        assert llama_cpp.WHO and not alias.installed()
    """, path=[peer])
    assert r.returncode == 0, r.stderr
    assert "imported already" in r.stdout and "as-llama-cpp" in r.stdout


def test_runner_runs_a_program_as_it_is(tmp_path, third_party, smollm2_path, peer):
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(f"""
        import sys
        import someone_elses_lib
        llm = someone_elses_lib.load({str(smollm2_path)!r})
        print(sys.argv[1:], type(llm).__module__, __name__)
    """))
    r = run("", "as-llama-cpp", str(app), "--flag", "x", path=[third_party], module=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['--flag', 'x'] llamax.llama __main__"
    (third_party / "app_mod.py").write_text(app.read_text())
    r = run("", "as-llama-cpp", "-m", "app_mod", "y", path=[third_party], module=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['y'] llamax.llama __main__"
    # an installed llama-cpp-python: refused with the way out, unless --replace
    r = run("", "as-llama-cpp", str(app), path=[peer, third_party], module=True)
    assert r.returncode == 2 and "--replace" in r.stderr and r.stdout == ""
    r = run("", "as-llama-cpp", "--replace", str(app), path=[peer, third_party], module=True)
    assert r.returncode == 0, r.stderr
    assert "llamax.llama" in r.stdout and "hidden until" in r.stderr
    r = run("", "as-llama-cpp", module=True)
    assert r.returncode == 2 and "usage:" in r.stderr


def test_replace_must_be_a_bool():
    with pytest.raises(TypeError, match="replace must be a bool"):
        as_llama_cpp.install(replace="yes")
    assert issubclass(llamax.ShadowingError, (llamax.LlamaxError, ImportError))
