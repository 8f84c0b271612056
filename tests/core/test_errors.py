"""The error-kind table (csrc/llamax.h LLAMAX_ERROR_KINDS) and the llama.cpp
log phrases the shim classifies failures by."""
import errno

import pytest

import llamax
from llamax import _core

from llamax_dev import data


def test_every_log_phrase_is_still_in_llama_cpp():
    """A llama.cpp upgrade that rewords one of these messages would silently
    turn a typed error into another: each phrase must occur in the pinned
    source, in a file that logs or throws it."""
    src = data.vocab_dir().parent / "src"
    text = "\n".join(p.read_text(errors="replace") for p in src.glob("*.cpp"))
    phrases = _core._log_phrases()
    assert len(phrases) >= 8
    for phrase, cls in phrases:
        assert phrase in text, f"{phrase!r} is no longer in llama.cpp's src/: update kLogPhrases"
        assert issubclass(getattr(llamax, cls), llamax.LlamaxError)


@pytest.mark.parametrize("phrase,cls", [("wrong base model", "AdapterMismatchError"),
                                        ("arch mismatch", "AdapterMismatchError"),
                                        ("failed to allocate", "OutOfMemoryError")])
def test_phrase_mapping(phrase, cls):
    assert dict(_core._log_phrases())[phrase] == cls


@pytest.mark.slow  # slow tier: tests/core/test_lora.py checks the same refusal
def test_adapter_for_another_model_is_a_mismatch(gen_dir, smollm2_path, model):
    from llamax import gguf_tools as gt
    tiny = gt.make_tiny_llama(gen_dir / "errors_tiny.gguf", smollm2_path, seed=3)
    lora = gt.make_lora(tiny, gen_dir / "errors_tiny_lora.gguf", rank=2, seed=1)
    with pytest.raises(llamax.AdapterMismatchError):
        llamax.LoraAdapter(model, lora)


def test_load_error_carries_errno(tmp_path):
    with pytest.raises(llamax.LoadError) as e:
        llamax.Model(tmp_path / "missing.gguf")
    assert e.value.errno == errno.ENOENT
    assert isinstance(e.value, OSError) and "missing.gguf" in str(e.value)
    with pytest.raises(llamax.LoadError) as e:
        llamax.Model(tmp_path)
    assert e.value.errno == errno.EISDIR
