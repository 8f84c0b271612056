"""PEFT LoRA adapters → llama.cpp's LoRA GGUF, for a GGUF base model.

A PEFT LoRA is, per target module, ``lora_A`` (r × in) and ``lora_B``
(out × r) and a scale (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA,
per module with ``rank_pattern``/``alpha_pattern``).  llama.cpp's LoRA GGUF
holds the same two matrices per base tensor (``blk.N.attn_q.weight.lora_a``
/ ``.lora_b``) and one ``adapter.lora.alpha`` (scale = alpha / rank).  The
conversion is therefore a renaming (through gguf-py's own tensor name map,
the one llama.cpp's converters use), the permutation llama.cpp applies to
LLaMA-family query/key rows (on ``lora_B``'s rows, as its converter does),
and the module scales folded into ``lora_B`` where one alpha can't express
them.  No torch: ``.safetensors`` is read with numpy, and ``.bin`` (torch's
zip pickle) through a restricted unpickler that only rebuilds tensors.

Written here rather than run through llama.cpp's ``convert_lora_to_gguf.py``
because that needs torch, transformers and the base model's Hugging Face
config (our bases are GGUF files); this is about 300 lines, exact (checked
against PEFT in PyTorch in tests/adapters/test_peft.py), and checks the
adapter against the GGUF base's own tensor shapes.

Refused with :class:`llamax.PeftError` (a ``ValueError``), naming the
problem: not a LoRA (other PEFT types), DoRA, trained biases,
``modules_to_save`` (full weights, not low rank), target modules that have
no tensor in the base, shapes that don't match the base, architectures
whose tensor layout this module does not know.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path

import numpy as np

from llamax._errors import PeftError
from llamax.gguf_tools import write_gguf

__all__ = ["convert", "cached", "is_peft_dir", "PeftError"]

# architectures (GGUF general.architecture) whose query/key rows llama.cpp's
# converter permutes (LLaMA's rotary layout), and those it leaves alone
_PERMUTE_QK = {"llama": True, "mistral": False, "qwen2": False, "qwen3": False, "gemma": False,
               "gemma2": False, "phi3": False, "starcoder2": False, "granite": False}
_PREFIXES = ("base_model.model.", "base_model.")


def is_peft_dir(path) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "adapter_config.json"))


def convert(peft_dir, base, out, *, dtype: str = "f32") -> Path:
    """Convert the PEFT LoRA in ``peft_dir`` for the GGUF model ``base``;
    writes llama.cpp's LoRA GGUF to ``out`` and returns its path."""
    if dtype not in ("f32", "f16"):
        raise PeftError(f"dtype must be f32 or f16, not {dtype!r}")
    import gguf
    peft_dir = Path(peft_dir)
    cfg = _config(peft_dir)
    arch, n_head, n_head_kv, n_layer, shapes = _base(base)
    if arch not in _PERMUTE_QK:
        raise PeftError(f"{base}: architecture {arch!r} is not one this converter knows (known: "
                        f"{sorted(_PERMUTE_QK)}); llama.cpp's convert_lora_to_gguf.py may convert it")
    tensors = _weights(peft_dir)
    names = gguf.get_tensor_name_map(_arch_enum(arch), n_layer)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, arr in tensors.items():
        module, half = _split(key)
        pairs.setdefault(module, {})[half] = arr
    out_tensors = []
    alpha_out = None
    for module in sorted(pairs, key=_natural):
        halves = pairs[module]
        if set(halves) != {"A", "B"}:
            raise PeftError(f"{module}: has {sorted(halves)}, a LoRA module needs lora_A and lora_B")
        a, b = halves["A"].astype(np.float32), halves["B"].astype(np.float32)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise PeftError(f"{module}: lora_A {a.shape} and lora_B {b.shape} are not a rank-r pair")
        if cfg.get("fan_in_fan_out"):
            a, b = b.T.copy(), a.T.copy()
        name = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if name is None or name not in shapes:
            raise PeftError(f"target module {module!r} has no tensor in the base model {Path(base).name} "
                            "(llama.cpp applies LoRA to its per-layer weight matrices)")
        n_in, n_out = shapes[name]
        if a.shape[1] != n_in or b.shape[0] != n_out:
            raise PeftError(f"{module}: the adapter is {b.shape[0]}x{a.shape[1]} but {name} in the base is "
                            f"{n_out}x{n_in}: an adapter for another model?")
        r = a.shape[0]
        scale = _scale(cfg, module, r)
        if alpha_out is None:
            alpha_out = scale * r
        fold = scale / (alpha_out / r)
        if fold != 1.0:
            b = b * np.float32(fold)
        if _PERMUTE_QK[arch] and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = n_head if name.endswith("attn_q.weight") else n_head_kv
            b = _permute(b, heads)
        out_tensors.append((name, a, b))
    if not out_tensors:
        raise PeftError(f"{peft_dir}: the adapter has no LoRA weights")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np_dtype = np.float32 if dtype == "f32" else np.float16

    def fill(w):
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", float(alpha_out))
        w.add_string("general.name", peft_dir.name)
        for name, a, b in out_tensors:
            w.add_tensor(name + ".lora_a", np.ascontiguousarray(a, dtype=np_dtype))
            w.add_tensor(name + ".lora_b", np.ascontiguousarray(b, dtype=np_dtype))
    write_gguf(out, arch, fill)
    return out


def cached(peft_dir, base, cache_dir) -> Path:
    """The converted GGUF of ``peft_dir`` for ``base``, converted once and
    kept under ``cache_dir`` by the content hash of the adapter's files and
    of the base's identity (path, size, mtime)."""
    peft_dir = Path(peft_dir)
    h = hashlib.sha256()
    for f in sorted(peft_dir.iterdir()):
        if f.name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    st = os.stat(base)
    h.update(f"{os.path.realpath(base)}|{st.st_size}|{st.st_mtime_ns}".encode())
    out = Path(cache_dir) / f"{h.hexdigest()[:32]}.gguf"
    if not out.is_file():
        convert(peft_dir, base, out)
    return out


# -- the PEFT side ----------------------------------------------------------------------------

def _config(peft_dir: Path) -> dict:
    p = peft_dir / "adapter_config.json"
    if not p.is_file():
        raise PeftError(f"{peft_dir}: no adapter_config.json (not a PEFT adapter directory)")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise PeftError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise PeftError(f"{p}: not a JSON object")
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise PeftError(f"{peft_dir}: peft_type is {kind!r}; only LoRA adapters (LORA) convert to llama.cpp")
    if cfg.get("use_dora"):
        raise PeftError(f"{peft_dir}: a DoRA adapter (use_dora): llama.cpp applies plain LoRA only")
    if cfg.get("bias", "none") != "none":
        raise PeftError(f"{peft_dir}: the adapter trains biases (bias={cfg['bias']!r}); llama.cpp's LoRA "
                        "has no bias terms")
    if cfg.get("modules_to_save"):
        raise PeftError(f"{peft_dir}: modules_to_save {cfg['modules_to_save']} are full weights, not low "
                        "rank: llama.cpp's LoRA can't hold them")
    for k in ("r", "lora_alpha"):
        v = cfg.get(k)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise PeftError(f"{p}: {k} must be a positive number, not {v!r}")
    return cfg


def _scale(cfg: dict, module: str, r: int) -> float:
    """PEFT's scaling of one module: alpha / r (or / sqrt(r) with rsLoRA),
    with rank_pattern / alpha_pattern matched on the module's name."""
    alpha = float(cfg["lora_alpha"])
    for pat, v in (cfg.get("alpha_pattern") or {}).items():
        if _matches(module, pat):
            alpha = float(v)
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _matches(module: str, pattern: str) -> bool:
    return re.match(rf"(.*\.)?({pattern})$", module) is not None


def _split(key: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' ->
    ('model.layers.0.self_attn.q_proj', 'A')."""
    for p in _PREFIXES:
        if key.startswith(p):
            key = key[len(p):]
            break
    parts = key.split(".")
    for half in ("A", "B"):
        tag = f"lora_{half}"
        if tag in parts:
            i = parts.index(tag)
            return ".".join(parts[:i]), half
    if "lora_magnitude_vector" in parts:
        raise PeftError("the adapter has DoRA magnitude vectors: llama.cpp applies plain LoRA only")
    if "lora_embedding_A" in parts or "lora_embedding_B" in parts:
        raise PeftError(f"{key}: LoRA on embeddings is not supported; target the layers' linear modules")
    raise PeftError(f"{key}: not a LoRA weight (expected lora_A / lora_B)")


def _weights(peft_dir: Path) -> dict[str, np.ndarray]:
    st = peft_dir / "adapter_model.safetensors"
    if st.is_file():
        return _read_safetensors(st)
    bn = peft_dir / "adapter_model.bin"
    if bn.is_file():
        return _read_torch_zip(bn)
    raise PeftError(f"{peft_dir}: no adapter_model.safetensors or adapter_model.bin")


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": "bf16"}


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
    except (struct.error, ValueError, UnicodeDecodeError):
        raise PeftError(f"{path}: not a safetensors file") from None
    base = 8 + n
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        try:
            dt = _ST_DTYPES[v["dtype"]]
            start, end = v["data_offsets"]
            shape = tuple(v["shape"])
        except (KeyError, TypeError, ValueError):
            raise PeftError(f"{path}: tensor {k!r}: unsupported entry {v!r}") from None
        raw = data[base + start: base + end]
        if dt == "bf16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(dt).newbyteorder("<"))
        if arr.size != math.prod(shape):
            raise PeftError(f"{path}: tensor {k!r}: {arr.size} values for shape {shape}")
        out[k] = arr.reshape(shape).astype(np.float32)
    return out


class _TorchUnpickler(pickle.Unpickler):
    """Rebuilds the tensors of a torch zip checkpoint as numpy arrays and
    refuses every other global (no code runs)."""

    _STORAGES = {"FloatStorage": np.float32, "HalfStorage": np.float16, "DoubleStorage": np.float64,
                 "BFloat16Storage": "bf16"}

    def __init__(self, f, zf: zipfile.ZipFile, prefix: str):
        super().__init__(f)
        self.zf, self.prefix = zf, prefix

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            import collections
            return collections.OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in self._STORAGES:
            return ("storage", self._STORAGES[name])
        raise PeftError(f"adapter_model.bin refers to {module}.{name}: only tensors are read from it")

    def persistent_load(self, pid):
        kind, storage, key, _location, numel = pid[:5]
        if kind != "storage":
            raise PeftError("adapter_model.bin: an unknown persistent object")
        dt = storage[1] if isinstance(storage, tuple) else None
        if dt is None:
            raise PeftError("adapter_model.bin: an unsupported storage type")
        raw = self.zf.read(f"{self.prefix}/data/{key}")
        if dt == "bf16":
            return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        return np.frombuffer(raw, dtype=np.dtype(dt).newbyteorder("<"))


def _rebuild_tensor(storage, offset, size, stride, *_):
    itemsize = storage.dtype.itemsize
    if not size:
        return storage[offset:offset + 1].reshape(())
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=tuple(size),
                                           strides=tuple(s * itemsize for s in stride)).copy()


def _read_torch_zip(path: Path) -> dict[str, np.ndarray]:
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise PeftError(f"{path}: not a torch zip checkpoint (a legacy pickle? re-save it with "
                        "safe_serialization=True)") from None
    with zf:
        pkl = [n for n in zf.namelist() if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise PeftError(f"{path}: not a torch zip checkpoint")
        prefix = pkl[0][:-len("/data.pkl")]
        with zf.open(pkl[0]) as f:
            try:
                obj = _TorchUnpickler(f, zf, prefix).load()
            except PeftError:
                raise
            except Exception as e:
                raise PeftError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise PeftError(f"{path}: not a state dict")
    return {k: np.asarray(v, dtype=np.float32) for k, v in obj.items()}


# -- the GGUF side ----------------------------------------------------------------------------

def _arch_enum(arch: str):
    import gguf
    for k, v in gguf.MODEL_ARCH_NAMES.items():
        if v == arch:
            return k
    raise PeftError(f"architecture {arch!r} is unknown to gguf-py")


def _base(base) -> tuple[str, int, int, int, dict[str, tuple[int, int]]]:
    import gguf

    from llamax.gguf_tools import _field
    try:
        r = gguf.GGUFReader(os.fspath(base))
    except (OSError, ValueError) as e:
        raise PeftError(f"{base}: not a readable GGUF model ({e})") from None
    arch = _field(r, "general.architecture")
    if _field(r, "general.type") == "adapter":
        raise PeftError(f"{base}: an adapter, not a base model")
    n_head = _field(r, f"{arch}.attention.head_count")
    n_head_kv = _field(r, f"{arch}.attention.head_count_kv") or n_head
    n_layer = _field(r, f"{arch}.block_count")
    if not (isinstance(arch, str) and isinstance(n_head, int) and isinstance(n_layer, int)):
        raise PeftError(f"{base}: not a transformer GGUF this converter understands")
    shapes = {t.name: (int(t.shape[0]), int(t.shape[1])) for t in r.tensors if len(t.shape) == 2}
    return arch, n_head, int(n_head_kv), n_layer, shapes


def _permute(b: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's query/key row order (LLaMA's rotary halves
    interleaved), applied to lora_B's rows (the output features)."""
    out = b.shape[0]
    return b.reshape(n_head, 2, out // n_head // 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape).copy()


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]
