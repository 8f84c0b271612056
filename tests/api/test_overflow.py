"""An adapter scale (or control vector) large enough to overflow the model
makes its logits and embeddings NaN: every path raises a typed error that
says so, instead of sampling garbage or handing NaN on (JSON has no NaN).
Found by the HTTP fuzz (an embeddings answer carried NaN)."""
import pytest

import llamax

from .conftest import make_llama

HUGE = [{"name": "coder", "scale": 1e6}]   # (1e3 still computes; 1e6 overflows SmolLM2 with this adapter)


@pytest.mark.parametrize("n_parallel", [1, 2], ids=["one-context", "batcher"])
def test_overflowing_adapter_scale_raises(smollm2_path, api_loras, n_parallel):
    with make_llama(smollm2_path, n_ctx=256, n_parallel=n_parallel) as m:
        m.load_lora("coder", api_loras["coder"])
        for kw in (dict(temperature=0.0), dict(temperature=0.8, seed=1), dict(temperature=0.0, logprobs=2)):
            with pytest.raises(llamax.InvalidArgumentError, match="not finite"):
                m.create_completion("Hello", max_tokens=3, active_loras=HUGE, cache_prompt=False, **kw)
        with pytest.raises(llamax.InvalidArgumentError, match="not finite"):
            m.embed_array(["Hello there"], active_loras=HUGE)
        # the Llama is fine afterwards, and a sane scale computes
        assert m.create_completion("Hello", max_tokens=3, temperature=0.0)["usage"]["completion_tokens"] >= 1
        m.create_completion("Hello", max_tokens=3, temperature=0.0, active_loras=[{"name": "coder", "scale": 2.0}])
