"""Control vectors trained in-process from contrastive prompts, and written
as llama.cpp's control-vector GGUF.

``ControlVector.train(model, positive=[...], negative=[...], method=...)``
decodes every prompt once in a context of its own whose eval callback (in
the shim, without the GIL, no Python per tensor) copies each layer's output
at the prompt's last token -- llama.cpp's ``l_out-N`` tensor, the very place
its control vectors are added.  Per layer, from the positive and negative
states:

- ``mean_diff``: mean(positive) - mean(negative);
- ``pca`` (pairs: ``positive[i]`` against ``negative[i]``): the first
  principal direction of the pairs' differences (uncentred, as llama.cpp's
  cvector-generator takes it), signed so that positives project above
  negatives, and scaled by the mean projection of the differences on it.

Both are in the model's own units, divided by the number of layers the
vector covers: llama.cpp adds a layer's row to that layer's output, and the
residual stream carries every addition on to the next layers, so at scale
1 the pushes add up to about the average distance between a negative
prompt's state and a positive one's.  Scales around 0.25-1 are the useful
ones; the sign picks the side.
Layers: 1 .. n_layer-1 by default (llama.cpp never applies a vector to
layer 0).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from llamax._errors import ArgumentTypeError, InvalidArgumentError
from llamax._validate import check_int

METHODS = ("pca", "mean_diff")


def _prompts(model, prompts, what: str) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise ArgumentTypeError(f"{what} must be a list of prompts (str or token lists)")
    if not prompts:
        raise InvalidArgumentError(f"{what} is empty")
    toks = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            t = model.tokenize(p, add_special=True, parse_special=True)
        elif isinstance(p, (list, tuple, np.ndarray)):
            t = np.asarray(p, dtype=np.int64)
            if t.ndim != 1:
                raise ArgumentTypeError(f"{what}[{i}]: a token list must be 1-D")
        else:
            raise ArgumentTypeError(f"{what}[{i}] must be a str or a list of token ids, "
                                    f"not {type(p).__name__}")
        if len(t) == 0:
            raise InvalidArgumentError(f"{what}[{i}] has no tokens")
        toks.append(np.asarray(t, dtype=np.int64))
    offsets = np.zeros(len(toks) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in toks], out=offsets[1:])
    flat = np.concatenate(toks)
    if flat.min() < np.iinfo(np.int32).min or flat.max() > np.iinfo(np.int32).max:
        raise InvalidArgumentError(f"{what}: a token id is out of range")
    return flat.astype(np.int32), offsets


def layer_outputs(model, prompts, *, n_threads: int | None = None) -> np.ndarray:
    """(n_prompts, n_layer, n_embd) float32: each layer's output at the last
    token of each prompt (str prompts are tokenized with special tokens)."""
    from llamax import _core
    tokens, offsets = _prompts(model, prompts, "prompts")
    return _core._layer_outputs(model, tokens, offsets, _threads(n_threads))


def _threads(n_threads: int | None) -> int:
    from llamax._cpus import usable_cores
    return min(usable_cores(), 8) if n_threads is None else n_threads


def train(model, positive, negative, *, method: str = "pca", layer_start: int = 1, layer_end: int | None = None,
          n_threads: int | None = None):
    """A :class:`llamax.ControlVector` for ``model`` pointing from the
    ``negative`` prompts towards the ``positive`` ones (see the module)."""
    from llamax import _core
    if not isinstance(model, _core.Model):
        raise ArgumentTypeError(f"model must be a llamax.Model, not {type(model).__name__}")
    if model.vocab_only:
        raise InvalidArgumentError("the model was loaded with vocab_only=True: it has no weights to run")
    if method not in METHODS:
        raise InvalidArgumentError(f"method must be one of {METHODS}, not {method!r}")
    n_layer = model.n_layer
    if layer_end is None:
        layer_end = n_layer - 1
    layer_start, layer_end = check_int(layer_start, "layer_start"), check_int(layer_end, "layer_end")
    if not 1 <= layer_start <= layer_end <= n_layer - 1:
        raise InvalidArgumentError(f"layers must satisfy 1 <= layer_start <= layer_end <= {n_layer - 1} "
                                   f"(llama.cpp applies control vectors to layers 1..n_layer-1), not "
                                   f"{layer_start}..{layer_end}")
    pos_t = _prompts(model, positive, "positive")
    neg_t = _prompts(model, negative, "negative")
    if method == "pca" and len(pos_t[1]) != len(neg_t[1]):
        raise InvalidArgumentError(f"method='pca' takes pairs: {len(pos_t[1]) - 1} positive and "
                                   f"{len(neg_t[1]) - 1} negative prompts (use method='mean_diff' for "
                                   "unpaired sets)")
    pos = _core._layer_outputs(model, *pos_t, _threads(n_threads))
    neg = _core._layer_outputs(model, *neg_t, _threads(n_threads))
    rows = np.empty((layer_end - layer_start + 1, model.n_embd), dtype=np.float32)
    for k, il in enumerate(range(layer_start, layer_end + 1)):
        p, n = pos[:, il].astype(np.float64), neg[:, il].astype(np.float64)
        if method == "mean_diff":
            rows[k] = p.mean(0) - n.mean(0)
            continue
        d = p - n
        _, _, vt = np.linalg.svd(d, full_matrices=False)
        v = vt[0]
        proj = d @ v
        if proj.mean() < 0:
            v, proj = -v, -proj
        rows[k] = v * proj.mean()
    rows /= layer_end - layer_start + 1
    if not np.isfinite(rows).all():
        raise InvalidArgumentError("the hidden states gave a non-finite direction (a broken model?)")
    return _core.ControlVector.from_rows(model, rows, layer_start, layer_end)


def save(cv, path, *, model_hint: str | None = None) -> Path:
    """Write ``cv`` as llama.cpp's control-vector GGUF: one ``direction.N``
    float32 tensor per layer N in its range."""
    from llamax.gguf_tools import write_control_vector
    data = np.asarray(cv.data, dtype=np.float32).reshape(-1, cv.n_embd)   # row 0 = layer 1
    if model_hint is None:
        model_hint = cv.model.metadata.get("general.architecture", "llama")
    rows = {il: data[il - 1] for il in range(cv.layer_start, cv.layer_end + 1)}
    return write_control_vector(path, rows, model_hint=model_hint)
