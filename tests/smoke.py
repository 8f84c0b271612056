"""Smoke test for an installed llamax (wheel checks, cibuildwheel).

Run from anywhere: it needs only the installed package, and fetches the
SmolLM2 test model into the cache if it is not there.  With --vocab PATH it
only tokenizes (for builders without network access to the model).
"""
import os
import sys


import llamax


def _model_path():
    if len(sys.argv) > 1:
        return sys.argv[1]
    from llamax.models import default_model
    return str(default_model(progress=True))


def main():
    # an installed package, not a checkout's source folder
    assert "site-packages" in llamax.__file__ or "dist-packages" in llamax.__file__, llamax.__file__
    path = _model_path()
    m = llamax.Model(path)
    c = llamax.Context(m, n_ctx=256, n_threads=2)
    toks = m.tokenize("The capital of France is")
    out, finish = c.generate(toks, llamax.Sampler(m), max_tokens=8, ignore_eos=True)
    text = m.detokenize_text(out, errors="replace")
    c.kv_clear()
    c.decode(toks)
    logits = c.get_logits()
    assert logits.shape == (1, m.n_vocab) and not logits.flags.writeable
    print(f"llamax {llamax.__version__} from {os.path.dirname(llamax.__file__)}")
    print(f"generated {len(out)} tokens ({finish}): {text!r}")
    print("smoke OK")


if __name__ == "__main__":
    main()
