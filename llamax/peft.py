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
import io
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
from llamax._validate import is_int, is_number
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
        if not is_number(v) or v <= 0:
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


# Files from elsewhere: every size, offset and stride in them is checked
# against the bytes actually there before a view is made, and what is
# materialised is bounded by what the file holds (no view repeats data).
_MAX_DIMS = 16
_ST_DTYPES = {"F32": "f4", "F16": "f2", "F64": "f8", "BF16": "bf16"}


def _shape(v, what: str, path) -> tuple:
    if not isinstance(v, (list, tuple)) or len(v) > _MAX_DIMS or not all(is_int(d, 0) for d in v):
        raise PeftError(f"{path}: {what}: {_short(v)} is not a shape (at most {_MAX_DIMS} non-negative ints)")
    return tuple(v)


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _bf16(raw, order: str = "<") -> np.ndarray:
    return (np.frombuffer(raw, dtype=order + "u2").astype(np.uint32) << 16).view(np.float32)


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    data = path.read_bytes()
    try:
        (n,) = struct.unpack("<Q", data[:8])
        if n > len(data) - 8:
            raise ValueError("header past the end")
        header = json.loads(data[8:8 + n])
    except (struct.error, ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise PeftError(f"{path}: not a safetensors file") from None
    if not isinstance(header, dict):
        raise PeftError(f"{path}: not a safetensors file (the header is not a JSON object)")
    body = memoryview(data)[8 + n:]
    out, used = {}, 0
    for k, v in header.items():
        if k == "__metadata__":
            continue
        if not isinstance(v, dict) or not isinstance(v.get("dtype"), str) or v["dtype"] not in _ST_DTYPES:
            raise PeftError(f"{path}: tensor {k!r}: unsupported entry {_short(v)}")
        dt = _ST_DTYPES[v["dtype"]]
        shape = _shape(v.get("shape"), f"tensor {k!r}", path)
        offsets = v.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o, 0) for o in offsets)
                and offsets[0] <= offsets[1] <= len(body)):
            raise PeftError(f"{path}: tensor {k!r}: data_offsets {_short(offsets)} are not a range within "
                            f"the file's {len(body)} data bytes")
        start, end = offsets
        itemsize = 2 if dt == "bf16" else np.dtype(dt).itemsize
        if end - start != math.prod(shape) * itemsize:
            raise PeftError(f"{path}: tensor {k!r}: {end - start} bytes for shape {shape} of {v['dtype']}")
        # ranges that repeat the same bytes would multiply memory: together
        # they may not hold more than the file does
        used += end - start
        if used > len(body):
            raise PeftError(f"{path}: the tensors' data ranges overlap (they add up to more than the file's "
                            f"{len(body)} data bytes)")
        raw = body[start:end]
        arr = _bf16(raw) if dt == "bf16" else np.frombuffer(raw, dtype="<" + dt)
        out[k] = arr.reshape(shape).astype(np.float32)
    return out


# -- torch's zip checkpoints (adapter_model.bin) --
#
# A torch zip holds ``<prefix>/data.pkl`` (the state dict, pickled; each
# tensor is ``_rebuild_tensor_v2(storage, offset, size, stride, ...)``) and
# one member ``<prefix>/data/<key>`` per storage, stored uncompressed.  The
# pickle is read by an unpickler that knows four globals and no code; the
# rest is numbers, and each is checked before anything is allocated from it:
# a member's declared size against the storage's element count and against
# what the archive can hold (at most _MAX_INFLATE times its size on disk:
# torch stores members, so an honest file inflates 1x), a tensor's offset,
# sizes and strides against its storage's length.  Each storage is read once
# and shared by the tensors that refer to it, and the tensors together may
# not hold more bytes than the storages do.

_MAX_INFLATE = 8
_CHUNK = 1 << 20  # zipfile decompresses at most this much per read


class _Sealed:
    """Objects the unpickler hands out; a pickle can't rewrite them (BUILD
    would set their slots) or index into them (SETITEM)."""
    __slots__ = ()

    def __setstate__(self, state):
        raise PeftError(f"adapter_model.bin: the pickle modifies a {type(self).__name__.lstrip('_')}")


class _StorageType(_Sealed):
    """What ``torch.FloatStorage`` & co. unpickle to: only find_class hands these out."""
    __slots__ = ("name", "dtype", "itemsize")

    def __init__(self, name, dtype, itemsize):
        self.name, self.dtype, self.itemsize = name, dtype, itemsize


_STORAGE_TYPES = {name: _StorageType(name, dt, 2 if dt == "bf16" else np.dtype(dt).itemsize)
                  for name, dt in (("FloatStorage", "f4"), ("HalfStorage", "f2"), ("DoubleStorage", "f8"),
                                   ("BFloat16Storage", "bf16"))}


class _Storage(_Sealed):
    __slots__ = ("key", "type", "numel", "array")

    def __init__(self, key, stype, numel, array):
        self.key, self.type, self.numel, self.array = key, stype, numel, array


class _Tensor(_Sealed):
    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array


class _TorchUnpickler(pickle.Unpickler):
    """Rebuilds the tensors of a torch zip checkpoint as numpy arrays and
    refuses every other global (no code runs)."""

    def __init__(self, f, zf: zipfile.ZipFile, prefix: str, path: Path, budget: "_Budget"):
        super().__init__(f)
        self.zf, self.prefix, self.path, self.budget = zf, prefix, path, budget
        self.order = _byteorder(zf, prefix, path, budget)
        self.storages: dict[str, _Storage] = {}
        self.tensor_bytes = 0
        self.storage_bytes = 0

    def find_class(self, module, name):
        if module == "collections" and name == "OrderedDict":
            import collections
            return collections.OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild_tensor
        if module == "torch" and name in _STORAGE_TYPES:
            return _STORAGE_TYPES[name]
        raise PeftError(f"adapter_model.bin refers to {module}.{name}: only tensors are read from it")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise PeftError(f"{self.path}: an unknown persistent object {_short(pid)}")
        _, stype, key, _location, numel = pid[:5]
        if not isinstance(stype, _StorageType):
            raise PeftError(f"{self.path}: an unsupported storage type {_short(stype)}")
        if not isinstance(key, str) or not is_int(numel, 0):
            raise PeftError(f"{self.path}: a storage named {_short(key)} with {_short(numel)} elements")
        s = self.storages.get(key)
        if s is None:  # read once; every later reference shares it
            s = self.storages[key] = self._read_storage(key, stype, numel)
        elif s.type is not stype or s.numel != numel:
            raise PeftError(f"{self.path}: storage {key!r} is referred to as {s.numel} {s.type.name} "
                            f"elements and as {numel} {stype.name}")
        return s

    def _read_storage(self, key: str, stype: _StorageType, numel: int) -> _Storage:
        name = f"{self.prefix}/data/{key}"
        nbytes = numel * stype.itemsize
        raw = _read_member(self.zf, name, self.path, self.budget, expect=nbytes,
                           what=f"storage {key!r} ({numel} {stype.name} elements)")
        if stype.dtype == "bf16":
            arr = _bf16(raw, self.order)
        else:
            arr = np.frombuffer(raw, dtype=self.order + stype.dtype)
        arr.flags.writeable = False
        self.storage_bytes += nbytes
        return _Storage(key, stype, numel, arr)

    def _rebuild_tensor(self, storage, offset, size, stride, *_rest):
        if not isinstance(storage, _Storage):
            raise PeftError(f"{self.path}: a tensor whose storage is {type(storage).__name__}, not a storage")
        where = f"{self.path}: a tensor on storage {storage.key!r}"
        size = _shape(size, f"tensor on storage {storage.key!r}: size", self.path)
        stride = _shape(stride, f"tensor on storage {storage.key!r}: stride", self.path)
        if len(stride) != len(size):
            raise PeftError(f"{where}: {len(size)} sizes but {len(stride)} strides")
        if not is_int(offset, 0):
            raise PeftError(f"{where}: storage offset {_short(offset)} is not a non-negative int")
        numel = math.prod(size)
        if offset > storage.numel:
            raise PeftError(f"{where}: storage offset {offset} is past its {storage.numel} elements")
        if numel:
            # the last element the view reaches, in Python ints (no overflow)
            last = offset + sum((n - 1) * s for n, s in zip(size, stride))
            if last >= storage.numel:
                raise PeftError(f"{where}: size {size}, stride {stride} and offset {offset} reach element "
                                f"{last}, past the storage's {storage.numel}")
        # views that repeat elements (stride 0, overlapping, several tensors
        # on the same data) would materialise more than the file holds
        self.tensor_bytes += numel * storage.type.itemsize
        if self.tensor_bytes > self.storage_bytes:
            raise PeftError(f"{self.path}: the tensors hold more bytes than their storages (views "
                            f"that repeat or overlap data); the one on storage {storage.key!r} has size {size}")
        itemsize = storage.array.dtype.itemsize
        if not numel:
            try:
                return _Tensor(np.zeros(size, storage.array.dtype))
            except ValueError:  # numpy's own limit on the product of the other dimensions
                raise PeftError(f"{where}: an empty tensor of size {size} is too big for numpy") from None
        # size-1 dimensions never step: their stride can be anything, make it 0
        strides = tuple(0 if n == 1 else s * itemsize for n, s in zip(size, stride))
        # numpy checks the view against the buffer again (it refuses anything past the end)
        view = np.ndarray(size, storage.array.dtype, buffer=storage.array, offset=offset * itemsize,
                          strides=strides)
        return _Tensor(view.copy())


class _Budget:
    """Bytes the zip's members may inflate to, in all."""

    def __init__(self, limit: int):
        self.left = limit


def _read_member(zf: zipfile.ZipFile, name: str, path: Path, budget: _Budget, *, expect=None,
                 what: str = "") -> bytearray:
    """A member's bytes, its declared size checked before anything is read
    (against ``expect`` and the budget), read in bounded chunks."""
    what = what or name
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise PeftError(f"{path}: {what}: the zip has no member {name}") from None
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        # zipfile's bzip2 and lzma readers inflate a whole read at once, unbounded
        raise PeftError(f"{path}: {name} is compressed with method {info.compress_type} (torch stores "
                        "members uncompressed; deflate is accepted)")
    size = info.file_size
    if expect is not None and size != expect:
        raise PeftError(f"{path}: {what}: needs {expect} bytes but {name} holds {size}")
    if size > budget.left:
        raise PeftError(f"{path}: {name} declares {size} bytes uncompressed: the members would inflate to more "
                        f"than {_MAX_INFLATE}x the file's size")
    budget.left -= size
    buf = bytearray(size)
    pos = 0
    with zf.open(info) as f:
        while pos < size:
            # read() of a deflated member decompresses at most what is asked
            chunk = f.read(min(_CHUNK, size - pos))
            if not chunk:
                raise PeftError(f"{path}: {name} is truncated ({pos} of {size} bytes)")
            buf[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
    return buf  # zipfile checked the CRC on reaching the declared size


def _byteorder(zf: zipfile.ZipFile, prefix: str, path: Path, budget: _Budget) -> str:
    name = f"{prefix}/byteorder"
    try:
        info = zf.getinfo(name)
    except KeyError:
        return "<"  # torch before 1.13 wrote no byteorder record: little-endian
    order = bytes(_read_member(zf, name, path, budget)) if info.file_size <= 16 else b"?"
    if order not in (b"little", b"big"):
        raise PeftError(f"{path}: {name} is {_short(order)}, not 'little' or 'big'")
    return "<" if order == b"little" else ">"


def _read_torch_zip(path: Path) -> dict[str, np.ndarray]:
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, ValueError, EOFError):
        raise PeftError(f"{path}: not a torch zip checkpoint (a legacy pickle? re-save it with "
                        "safe_serialization=True)") from None
    with zf:
        pkl = [n for n in zf.namelist() if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise PeftError(f"{path}: not a torch zip checkpoint")
        prefix = pkl[0][:-len("/data.pkl")]
        budget = _Budget(_MAX_INFLATE * os.path.getsize(path))
        try:
            # the pickle is read whole first (bounded like any member): the
            # unpickler then reads from memory, never asking zipfile for a
            # length a pickle opcode declares
            data = _read_member(zf, pkl[0], path, budget)
            obj = _TorchUnpickler(io.BytesIO(data), zf, prefix, path, budget).load()
        except PeftError:
            raise
        except Exception as e:
            raise PeftError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise PeftError(f"{path}: not a state dict")
    out = {}
    for k, v in obj.items():
        # only tensors: a list of a thousand references to one tensor would
        # otherwise become a thousand copies
        if not isinstance(k, str) or not isinstance(v, _Tensor):
            raise PeftError(f"{path}: the state dict maps {_short(k)} to {type(v).__name__}, not a tensor")
        out[k] = v.array.astype(np.float32)
    return out


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
