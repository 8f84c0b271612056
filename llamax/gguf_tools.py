"""Write GGUF files llamax consumes: LoRA adapters, control vectors, tiny models.

Seeded and deterministic, so tests and benchmarks can make their own data
for any base model instead of downloading it.  Needs the ``gguf`` package
(``pip install gguf``; it is in the ``test`` extra).

Shapes follow llama.cpp: a weight ``W`` with ggml shape ``[n_in, n_out]``
(numpy ``(n_out, n_in)``) gets ``lora_a`` of ggml shape ``[n_in, r]`` and
``lora_b`` of ``[r, n_out]``; llama.cpp adds
``scale * alpha / r * (B @ A) @ x``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

__all__ = ["make_lora", "make_control_vector", "make_tiny_llama", "make_tiny_mamba", "merge_lora", "model_shapes",
           "tokenizer_fields"]

DEFAULT_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("llamax.gguf_tools needs the 'gguf' package: pip install gguf") from e
    return gguf


def _field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def model_shapes(model_path: str | os.PathLike) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(architecture, {tensor name: ggml shape}) of a GGUF model, without loading its data.

    Remembered per file (path, inode, size and modification time): gguf's
    reader parses every metadata array, SmolLM2's 49,152 tokens and merges
    included, which took ~5 s per call, and tests make many adapters for
    one model."""
    st = os.stat(model_path)
    key = (os.path.realpath(model_path), st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _SHAPES.get(key)
    if hit is None:
        gguf = _gguf()
        r = gguf.GGUFReader(os.fspath(model_path))
        hit = (_field(r, "general.architecture"), {t.name: tuple(int(x) for x in t.shape) for t in r.tensors})
        _remember(key, hit)
    return hit[0], dict(hit[1])


_SHAPES: dict = {}  # model_shapes' answers, by file


def tokenizer_fields(path: str | os.PathLike) -> list:
    """The ``tokenizer.*`` metadata of a GGUF file as (key, contents,
    value type, array item type) tuples, what a GGUFWriter needs to copy
    them; remembered per file like :func:`model_shapes` (array contents
    as tuples)."""
    st = os.stat(path)
    key = ("tok", os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _SHAPES.get(key)
    if hit is None:
        r = _gguf().GGUFReader(os.fspath(path))
        hit = tuple((k, _frozen(f.contents()), f.types[0], f.types[1] if len(f.types) > 1 else None)
                    for k, f in r.fields.items() if k.startswith("tokenizer."))
        _remember(key, hit)
    return list(hit)


def _frozen(v):
    """a field's contents with lists made tuples (cached values nobody can change)"""
    return tuple(v) if isinstance(v, list) else v


def _remember(key, value) -> None:
    while len(_SHAPES) >= 32:
        _SHAPES.pop(next(iter(_SHAPES), None), None)
    _SHAPES[key] = value


def make_lora(model_path, out_path, *, rank: int = 8, alpha: float | None = None, seed: int = 0,
              targets: Iterable[str] = DEFAULT_TARGETS, layers: Sequence[int] | None = None,
              std: float = 0.02, arch: str | None = None, drop_b: bool = False,
              general_type: str = "adapter", shape_offset: int = 0) -> Path:
    """Write a seeded random LoRA adapter for the model at ``model_path``.

    ``targets`` names the per-block weights (``attn_q``, ``ffn_up``, ...);
    ``layers`` limits the blocks (default: all).  ``alpha`` defaults to
    ``rank`` (llama.cpp's scale factor alpha/rank = 1).  The last three
    options make deliberately broken adapters for error tests: ``arch``
    overrides the architecture, ``drop_b`` leaves out the ``lora_b`` halves,
    ``shape_offset`` makes ``lora_a`` the wrong width.
    """
    gguf = _gguf()
    model_arch, shapes = model_shapes(model_path)
    rng = np.random.default_rng(seed)
    out_path = Path(out_path)
    w = gguf.GGUFWriter(os.fspath(out_path), arch or model_arch)
    w.add_string("general.type", general_type)
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank if alpha is None else alpha))
    targets = tuple(targets)
    n_written = 0
    for name in sorted(shapes, key=_tensor_order):
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in targets:
            continue
        if layers is not None and int(parts[1]) not in layers:
            continue
        n_in, n_out = shapes[name][0], shapes[name][1]
        a = (rng.standard_normal((rank, n_in + shape_offset)) * std).astype(np.float32)
        b = (rng.standard_normal((n_out, rank)) * std).astype(np.float32)
        w.add_tensor(name + ".lora_a", a)
        if not drop_b:
            w.add_tensor(name + ".lora_b", b)
        n_written += 1
    if n_written == 0:
        raise ValueError(f"no tensor of {model_path} matches targets {targets}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_path


def _tensor_order(name: str):
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit():
        return (1, int(parts[1]), name)
    return (0, 0, name)


def lora_deltas(lora_path, scale: float = 1.0) -> dict[str, np.ndarray]:
    """{base tensor name: scale * alpha/r * B @ A} in numpy (n_out, n_in) layout."""
    gguf = _gguf()
    r = gguf.GGUFReader(os.fspath(lora_path))
    alpha = float(_field(r, "adapter.lora.alpha") or 0.0)
    halves: dict[str, dict[str, np.ndarray]] = {}
    for t in r.tensors:
        base, _, half = t.name.rpartition(".")
        halves.setdefault(base, {})[half] = np.array(t.data, dtype=np.float32)
    out = {}
    for base, h in halves.items():
        a, b = h["lora_a"], h["lora_b"]
        rank = a.shape[0]
        s = scale * (alpha / rank if alpha else 1.0)
        out[base] = (s * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)
    return out


def make_control_vector(out_path, n_embd: int, layers: Iterable[int], *, seed: int = 0,
                        std: float = 0.1, model_hint: str = "llama", zeros: bool = False) -> Path:
    """Write a seeded random llama.cpp control-vector GGUF: one ``direction.N`` F32 tensor per layer N."""
    rng = np.random.default_rng(seed)
    rows = {}
    for il in sorted(set(int(i) for i in layers)):
        rows[il] = np.zeros(n_embd, np.float32) if zeros else (rng.standard_normal(n_embd) * std).astype(np.float32)
    return write_control_vector(out_path, rows, model_hint=model_hint)


def write_control_vector(out_path, rows: dict[int, np.ndarray], *, model_hint: str = "llama") -> Path:
    """Write llama.cpp's control-vector GGUF ({layer N: n_embd floats} as
    F32 ``direction.N`` tensors, the layout its loaders read), atomically."""
    def fill(w):
        w.add_string("controlvector.model_hint", model_hint)
        w.add_int32("controlvector.layer_count", len(rows))
        for il in sorted(rows):
            w.add_tensor(f"direction.{il}", np.ascontiguousarray(rows[il], dtype=np.float32))
    return write_gguf(out_path, "controlvector", fill)


def write_gguf(out_path, arch: str, fill) -> Path:
    """A GGUF written atomically: ``fill(writer)`` adds the keys and tensors,
    the file appears under ``out_path`` only once it is complete."""
    gguf = _gguf()
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(os.fspath(tmp), arch)
    try:
        fill(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out_path


def make_tiny_llama(out_path, tokenizer_from, *, n_embd: int = 64, n_layer: int = 2, n_head: int = 4,
                    n_head_kv: int = 2, n_ff: int = 128, n_ctx: int = 512, seed: int = 0,
                    deltas: dict[str, np.ndarray] | None = None) -> Path:
    """A small random F32 llama model with the tokenizer of another GGUF.

    ``deltas`` ({tensor name: numpy (n_out, n_in) array}) are added to the
    weights: with :func:`lora_deltas` this writes a LoRA merged into the
    model, which run-time LoRA must reproduce.
    """
    gguf = _gguf()
    tok_fields = tokenizer_fields(tokenizer_from)
    n_vocab = len(next(c for k, c, _, _ in tok_fields if k == "tokenizer.ggml.tokens"))
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(os.fspath(out_path), "llama")
    w.add_string("general.name", "llamax tiny test llama")
    w.add_uint32("general.file_type", 0)
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    for key, contents, vtype, sub in tok_fields:
        w.add_key_value(key, contents, vtype, sub_type=sub)
    deltas = deltas or {}
    head_dim = n_embd // n_head

    def mat(name, n_out, n_in):
        m = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
        if name in deltas:
            m = m + deltas[name]
        w.add_tensor(name, m)

    mat("token_embd.weight", n_vocab, n_embd)
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    mat("output.weight", n_vocab, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, np.float32))
        mat(p + "attn_q.weight", n_embd, n_embd)
        mat(p + "attn_k.weight", n_head_kv * head_dim, n_embd)
        mat(p + "attn_v.weight", n_head_kv * head_dim, n_embd)
        mat(p + "attn_output.weight", n_embd, n_embd)
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, np.float32))
        mat(p + "ffn_gate.weight", n_ff, n_embd)
        mat(p + "ffn_up.weight", n_ff, n_embd)
        mat(p + "ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out_path)


def make_tiny_mamba(out_path, tokenizer_from, *, n_embd: int = 64, n_layer: int = 2, d_state: int = 16,
                    d_conv: int = 4, dt_rank: int = 8, n_ctx: int = 512, seed: int = 0) -> Path:
    """A small random F32 Mamba (recurrent) model with the tokenizer of another
    GGUF: what runs llama.cpp's recurrent-memory paths (and llamax's branches
    for them) without a downloaded model.  d_inner is 2 x n_embd, the only
    expansion llama.cpp's Mamba takes."""
    gguf = _gguf()
    tok_fields = tokenizer_fields(tokenizer_from)
    n_vocab = len(next(c for k, c, _, _ in tok_fields if k == "tokenizer.ggml.tokens"))
    d_inner = 2 * n_embd
    rng = np.random.default_rng(seed)

    def fill(w):
        w.add_string("general.name", "llamax tiny test mamba")
        w.add_uint32("general.file_type", 0)
        w.add_context_length(n_ctx)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_ssm_conv_kernel(d_conv)
        w.add_ssm_inner_size(d_inner)
        w.add_ssm_state_size(d_state)
        w.add_ssm_time_step_rank(dt_rank)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(n_vocab)
        for key, contents, vtype, sub in tok_fields:
            w.add_key_value(key, contents, vtype, sub_type=sub)

        def mat(name, n_out, n_in, scale=1.0):
            w.add_tensor(name, (scale * rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32))

        mat("token_embd.weight", n_vocab, n_embd)
        w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
        mat("output.weight", n_vocab, n_embd)
        for i in range(n_layer):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, np.float32))
            mat(p + "ssm_in.weight", 2 * d_inner, n_embd)
            mat(p + "ssm_conv1d.weight", d_inner, d_conv)
            w.add_tensor(p + "ssm_conv1d.bias", np.zeros(d_inner, np.float32))
            mat(p + "ssm_x.weight", dt_rank + 2 * d_state, d_inner)
            mat(p + "ssm_dt.weight", d_inner, dt_rank)
            w.add_tensor(p + "ssm_dt.bias", np.full(d_inner, -2.0, np.float32))
            # A = -exp(A_log): negative, so the state decays
            w.add_tensor(p + "ssm_a", -rng.uniform(0.5, 2.0, (d_inner, d_state)).astype(np.float32))
            w.add_tensor(p + "ssm_d", np.ones(d_inner, np.float32))
            mat(p + "ssm_out.weight", n_embd, d_inner)

    return write_gguf(out_path, "mamba", fill)


def merge_lora(out_path, tokenizer_from, lora_path, *, scale: float = 1.0, **tiny_kwargs) -> Path:
    """:func:`make_tiny_llama` with the adapter at ``lora_path`` merged in (same seed = same base)."""
    return make_tiny_llama(out_path, tokenizer_from, deltas=lora_deltas(lora_path, scale), **tiny_kwargs)
