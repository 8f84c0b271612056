"""PEFT adapter files from elsewhere: llamax.peft reads torch's zip pickles
and safetensors without trusting a number in them.

The files are made here by hand (zipfile, and pickle opcodes written one by
one: torch is not installed in the test environment), the way torch.save
lays them out, so both the well-formed and the hostile ones are exactly
what the test says.  No model is loaded: the base is a tiny GGUF written
with gguf-py.  test_peft.py (slow tier) checks real PEFT files against
PyTorch.
"""
from __future__ import annotations

import json
import pickle
import re
import struct
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest

import llamax
from conftest import run_py
from llamax import gguf_tools as gt
from llamax import peft

N_IN, N_OUT, R = 6, 8, 2
KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A GGUF 'model' with one 8x6 query matrix: all convert() reads of a base."""
    out = tmp_path_factory.mktemp("peft-base") / "base.gguf"

    def fill(w):
        w.add_uint32("qwen2.attention.head_count", 2)
        w.add_uint32("qwen2.block_count", 1)
        w.add_tensor("blk.0.attn_q.weight", np.zeros((N_OUT, N_IN), np.float32))
    return gt.write_gguf(out, "qwen2", fill)


# -- torch's zip layout, by hand ------------------------------------------------------------

class Tensor:
    """``_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())``."""

    def __init__(self, key, numel, offset, size, stride, storage="FloatStorage"):
        self.key, self.numel, self.offset, self.size, self.stride = key, numel, offset, size, stride
        self.storage = storage


class Raw:
    """Opcodes written as they are."""

    def __init__(self, data: bytes):
        self.data = data


def _int(v: int) -> bytes:
    if -2**31 <= v < 2**31:
        return pickle.BININT + struct.pack("<i", v)
    b = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return pickle.LONG1 + bytes([len(b)]) + b


def dumps(obj) -> bytes:
    """Protocol 2, as torch.save writes a state dict; a Tensor or list
    referred to twice is written once and then fetched from the memo, as
    pickle does for shared objects."""
    out, memo = [pickle.PROTO + b"\x02"], {}

    def ordered_dict():
        out.append(pickle.GLOBAL + b"collections\nOrderedDict\n" + pickle.EMPTY_TUPLE + pickle.REDUCE)

    def enc(v):
        if id(v) in memo:
            out.append(pickle.LONG_BINGET + struct.pack("<I", memo[id(v)]))
            return
        if isinstance(v, Raw):
            out.append(v.data)
        elif isinstance(v, bool):
            out.append(pickle.NEWTRUE if v else pickle.NEWFALSE)
        elif isinstance(v, int):
            out.append(_int(v))
        elif isinstance(v, float):
            out.append(pickle.BINFLOAT + struct.pack(">d", v))
        elif isinstance(v, str):
            b = v.encode()
            out.append(pickle.BINUNICODE + struct.pack("<I", len(b)) + b)
        elif isinstance(v, tuple):
            out.append(pickle.MARK)
            for x in v:
                enc(x)
            out.append(pickle.TUPLE)
        elif isinstance(v, dict):
            ordered_dict()
            out.append(pickle.MARK)
            for k, x in v.items():
                enc(k)
                enc(x)
            out.append(pickle.SETITEMS)
        elif isinstance(v, list):
            out.append(pickle.EMPTY_LIST)
            memo[id(v)] = len(memo)
            out.append(pickle.LONG_BINPUT + struct.pack("<I", memo[id(v)]))
            out.append(pickle.MARK)
            for x in v:
                enc(x)
            out.append(pickle.APPENDS)
            return
        elif isinstance(v, Tensor):
            out.append(pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n" + pickle.MARK)
            out.append(pickle.MARK)
            enc("storage")
            out.append(pickle.GLOBAL + f"torch\n{v.storage}\n".encode())
            for x in (v.key, "cpu", v.numel):
                enc(x)
            out.append(pickle.TUPLE + pickle.BINPERSID)
            for x in (v.offset, tuple(v.size), tuple(v.stride), False):
                enc(x)
            ordered_dict()
            out.append(pickle.TUPLE + pickle.REDUCE)
        else:
            raise TypeError(type(v))
        memo[id(v)] = len(memo)
        out.append(pickle.LONG_BINPUT + struct.pack("<I", memo[id(v)]))

    enc(obj)
    return b"".join(out) + pickle.STOP


def write_bin(path: Path, state, storages: dict[str, bytes], *, compress=zipfile.ZIP_STORED,
              byteorder: bytes | None = b"little", pkl: bytes | None = None) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", dumps(state) if pkl is None else pkl)
        if byteorder is not None:
            z.writestr("archive/byteorder", byteorder)
        for key, data in storages.items():
            z.writestr(f"archive/data/{key}", data, compress_type=compress)
        z.writestr("archive/version", b"3\n")
    return path


def adapter_dir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": R, "lora_alpha": R, "target_modules": ["q_proj"]}))
    return d


rng = np.random.default_rng(7)
A = rng.standard_normal((R, N_IN)).astype(np.float32)
B = rng.standard_normal((N_OUT, R)).astype(np.float32)


def good_state():
    """lora_A and lora_B as torch saves two parameters: one storage each."""
    return ({KEY.format("A"): Tensor("0", A.size, 0, A.shape, (N_IN, 1)),
             KEY.format("B"): Tensor("1", B.size, 0, B.shape, (R, 1))},
            {"0": A.tobytes(), "1": B.tobytes()})


def converted(d: Path, base: Path, out: Path):
    peft.convert(d, base, out)
    import gguf
    r = gguf.GGUFReader(str(out))
    t = {x.name: np.array(x.data) for x in r.tensors}
    return t["blk.0.attn_q.weight.lora_a"], t["blk.0.attn_q.weight.lora_b"]


# -- well-formed files still convert ------------------------------------------------------------

def test_a_torch_zip_converts(base, tmp_path):
    d = adapter_dir(tmp_path / "a")
    write_bin(d / "adapter_model.bin", *good_state())
    a, b = converted(d, base, tmp_path / "out.gguf")
    assert np.array_equal(a, A) and np.array_equal(b, B)


def test_views_of_one_storage_convert(base, tmp_path):
    """Both halves in one storage, lora_B saved transposed (a strided view)
    and at an offset: the layouts torch writes for views."""
    bt = np.ascontiguousarray(B.T)                    # (R, N_OUT), B's columns as rows
    storage = np.concatenate([A.ravel(), bt.ravel()])
    state = {KEY.format("A"): Tensor("0", storage.size, 0, A.shape, (N_IN, 1)),
             KEY.format("B"): Tensor("0", storage.size, A.size, B.shape, (1, N_OUT))}
    d = adapter_dir(tmp_path / "a")
    write_bin(d / "adapter_model.bin", state, {"0": storage.tobytes()})
    a, b = converted(d, base, tmp_path / "out.gguf")
    assert np.array_equal(a, A) and np.array_equal(b, B)


def test_half_and_big_endian_storages_convert(base, tmp_path):
    state = {KEY.format("A"): Tensor("0", A.size, 0, A.shape, (N_IN, 1), storage="HalfStorage"),
             KEY.format("B"): Tensor("1", B.size, 0, B.shape, (R, 1), storage="HalfStorage")}
    d = adapter_dir(tmp_path / "a")
    write_bin(d / "adapter_model.bin", state, {"0": A.astype(">f2").tobytes(), "1": B.astype(">f2").tobytes()},
              byteorder=b"big")
    a, b = converted(d, base, tmp_path / "out.gguf")
    assert np.array_equal(a, A.astype(np.float16).astype(np.float32))
    assert np.array_equal(b, B.astype(np.float16).astype(np.float32))


def test_each_storage_is_read_once(base, tmp_path, monkeypatch):
    """Forty tensors, each a slice of one storage: its member is read once
    and shared, not once per tensor."""
    data = np.arange(40 * 16, dtype=np.float32)
    state = {f"t{i}": Tensor("0", data.size, 16 * i, (16,), (1,)) for i in range(40)}
    path = write_bin(tmp_path / "adapter_model.bin", state, {"0": data.tobytes()})
    opened = []
    real_open = zipfile.ZipFile.open

    def counting_open(self, name, *a, **kw):
        opened.append(getattr(name, "filename", name))
        return real_open(self, name, *a, **kw)
    monkeypatch.setattr(zipfile.ZipFile, "open", counting_open)
    got = peft._read_torch_zip(path)
    monkeypatch.undo()
    assert opened.count("archive/data/0") == 1
    assert all(np.array_equal(got[f"t{i}"], data[16 * i:16 * (i + 1)]) for i in range(40))


# -- hostile torch zips are refused, naming what is wrong ------------------------------------------

def _t(**kw):
    """lora_A over a 12-float storage, with one field replaced."""
    args = dict(key="0", numel=12, offset=0, size=(R, N_IN), stride=(N_IN, 1))
    args.update(kw)
    return {KEY.format("A"): Tensor(**args), KEY.format("B"): Tensor("1", B.size, 0, B.shape, (R, 1))}


STORAGES = {"0": A.tobytes(), "1": B.tobytes()}

TORCH_BAD = [
    (_t(size=(-2, 6)), STORAGES, r"size: \(-2, 6\) is not a shape"),
    (_t(size=(2, 6.0)), STORAGES, r"size: \(2, 6.0\) is not a shape"),
    (_t(size=(1,) * 40, stride=(1,) * 40), STORAGES, "at most 16 non-negative ints"),
    (_t(stride=(6,)), STORAGES, "2 sizes but 1 strides"),
    (_t(offset=-1), STORAGES, "storage offset -1 is not a non-negative int"),
    # the pickle says 1000 elements, the member holds 12
    (_t(numel=1000), STORAGES, r"needs 4000 bytes but archive/data/0 holds 48"),
    (_t(key="9"), STORAGES, "the zip has no member archive/data/9"),
    # one float repeated 4M times by stride-0 dimensions (16 MiB from 4 bytes)
    (_t(size=(2048, 2048), stride=(0, 0), numel=1), {"0": b"\0" * 4, "1": B.tobytes()},
     "more bytes than their storages"),
    # the same storage, whole, under 1000 names (each a copy before)
    ({f"t{i}": Tensor("0", 16384, 0, (16384,), (1,)) for i in range(1000)}, {"0": bytes(65536)},
     "more bytes than their storages"),
    # a list of 1000 references to one 64 KiB tensor: np.asarray made 64 MiB of it
    ({"x": [Tensor("0", 16384, 0, (16384,), (1,))] * 1000}, {"0": bytes(65536)},
     "maps 'x' to list, not a tensor"),
    ({"x": Tensor("0", 12, 0, (0, 1 << 62), (1, 1))}, STORAGES, r"an empty tensor of size \(0, 4611686018427387904\)"),
    ({"x": 5}, {}, "maps 'x' to int, not a tensor"),
    ([Tensor("0", 12, 0, (12,), (1,))], STORAGES, "not a state dict"),
    # BUILD on what find_class hands out would rewrite llamax's storage types for the process
    ({"x": Raw(pickle.GLOBAL + b"torch\nFloatStorage\n" + pickle.NONE + pickle.MARK
               + pickle.BINUNICODE + struct.pack("<I", 8) + b"itemsize" + pickle.BININT1 + b"\0"
               + pickle.DICT + pickle.TUPLE2 + pickle.BUILD)}, {}, "modifies a StorageType"),
    ({"x": Raw(pickle.GLOBAL + b"torch\nFloatStorage\n")}, {}, "maps 'x' to _StorageType, not a tensor"),
]


@pytest.mark.parametrize("state,storages,match", TORCH_BAD, ids=[f"bad{i}" for i in range(len(TORCH_BAD))])
def test_hostile_torch_zips_are_refused(base, tmp_path, state, storages, match):
    d = adapter_dir(tmp_path / "a")
    write_bin(d / "adapter_model.bin", state, storages)
    with pytest.raises(llamax.PeftError, match=match):
        peft.convert(d, base, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
    assert peft._STORAGE_TYPES["FloatStorage"].itemsize == 4


@pytest.mark.parametrize("state,match", [
    # rows 4 GiB apart over a 48-byte storage
    ({KEY.format("A"): Tensor("0", 12, 0, (64, 6), (1 << 20, 1 << 30))}, "reach element 5434769408"),
    (_t(stride=(1 << 40, 1)), r"reach element 1099511627781, past the storage's 12"),
    (_t(offset=1000), "storage offset 1000 is past its 12 elements"),
    (_t(offset=7), r"offset 7 reach element 18, past the storage's 12"),
    (_t(stride=(-(1 << 30), 1)), r"stride: \(-1073741824, 1\) is not a shape"),
])
def test_out_of_bounds_views_are_refused_not_read(base, tmp_path, state, match):
    """In a fresh interpreter: these offsets and strides reach outside the
    storage, and the reader used to hand them to numpy's as_strided, which
    read there (SIGSEGV for the far ones)."""
    d = adapter_dir(tmp_path / "a")
    write_bin(d / "adapter_model.bin", state, STORAGES)
    r = run_py(f"""
        import llamax
        from llamax import peft
        try:
            peft.convert({str(d)!r}, {str(base)!r}, {str(tmp_path / "out.gguf")!r})
        except llamax.PeftError as e:
            print("PeftError:", e)
    """, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "PeftError:" in r.stdout, r.stdout
    assert re.search(match, r.stdout), r.stdout
    assert not (tmp_path / "out.gguf").exists()


def test_a_deflate_bomb_is_refused_before_inflating(base, tmp_path):
    """32 MiB of zeros deflate to 32 KiB: more than the file can honestly hold."""
    n = 8 << 20
    d = adapter_dir(tmp_path / "a")
    write_bin(d / "adapter_model.bin", {KEY.format("A"): Tensor("0", n, 0, (2048, 4096), (4096, 1))},
              {"0": bytes(4 * n)}, compress=zipfile.ZIP_DEFLATED)
    assert (d / "adapter_model.bin").stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(llamax.PeftError, match=r"declares 33554432 bytes uncompressed: .* more than 8x"):
            peft.convert(d, base, tmp_path / "out.gguf")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


def _lie_about_size(path: Path, member: str, size: int) -> None:
    """Rewrite ``member``'s uncompressed size in the zip's central directory."""
    with zipfile.ZipFile(path) as z:
        i = z.start_dir                       # the central directory's first record
    blob = bytearray(path.read_bytes())
    name = member.encode()
    while True:
        n = struct.unpack_from("<H", blob, i + 28)[0]
        if blob[i + 46:i + 46 + n] == name:
            struct.pack_into("<I", blob, i + 24, size)
            break
        i = blob.index(b"PK\x01\x02", i + 46)
    path.write_bytes(bytes(blob))


@pytest.mark.parametrize("member", ["archive/data/0", "archive/data.pkl"])
def test_a_member_that_understates_its_size_is_not_inflated(base, tmp_path, member):
    """A deflated member whose declared size is small and whose stream
    inflates to 64 MiB: read in bounded chunks, zipfile stops at the
    declared size and the CRC refuses it (zipfile.read() inflated it all)."""
    d = adapter_dir(tmp_path / "a")
    path = d / "adapter_model.bin"
    if member == "archive/data.pkl":
        # a pickle of one 64 MiB string, compressed
        s = b"x" * (64 << 20)
        pkl = pickle.PROTO + b"\x02" + pickle.BINUNICODE + struct.pack("<I", len(s)) + s + pickle.STOP
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("archive/data.pkl", pkl, compress_type=zipfile.ZIP_DEFLATED)
        # past what the unpickler prefetches (128 KiB), so that it asks for the string
        size = 256 << 10
    else:
        write_bin(path, {KEY.format("A"): Tensor("0", 12, 0, (R, N_IN), (N_IN, 1))},
                  {"0": bytes(64 << 20)}, compress=zipfile.ZIP_DEFLATED)
        size = 48
    _lie_about_size(path, member, size)
    tracemalloc.start()
    try:
        with pytest.raises(llamax.PeftError, match="unreadable|not a"):
            peft.convert(d, base, tmp_path / "out.gguf")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


def test_lzma_members_are_refused(base, tmp_path):
    """zipfile inflates a bzip2 or lzma read whole; torch never writes them."""
    d = adapter_dir(tmp_path / "a")
    state, storages = good_state()
    write_bin(d / "adapter_model.bin", state, storages, compress=zipfile.ZIP_LZMA)
    with pytest.raises(llamax.PeftError, match="compressed with method 14"):
        peft.convert(d, base, tmp_path / "out.gguf")


@pytest.mark.parametrize("byteorder", [b"middle", b"x" * 100], ids=["middle", "long"])
def test_a_bad_byteorder_is_refused(base, tmp_path, byteorder):
    d = adapter_dir(tmp_path / "a")
    write_bin(d / "adapter_model.bin", *good_state(), byteorder=byteorder)
    with pytest.raises(llamax.PeftError, match="not 'little' or 'big'"):
        peft.convert(d, base, tmp_path / "out.gguf")


# -- safetensors -------------------------------------------------------------------------

def _st(path: Path, header, body: bytes = b"") -> None:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + body)


ST_BAD = [
    (b"[" * 100000 + b"]" * 100000, b"", "not a safetensors file"),      # RecursionError in json
    ([1, 2], b"", "the header is not a JSON object"),
    ({"t": [1]}, b"", "unsupported entry"),
    ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, bytes(8), "not a range within"),
    ({"t": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}, bytes(8), "is not a shape"),
    ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "8 bytes for shape"),
    # the same 64 KiB under 1000 names
    ({f"t{i}": {"dtype": "F32", "shape": [16384], "data_offsets": [0, 65536]} for i in range(1000)},
     bytes(65536), "overlap"),
]


@pytest.mark.parametrize("header,body,match", ST_BAD, ids=[f"bad{i}" for i in range(len(ST_BAD))])
def test_hostile_safetensors_are_refused(base, tmp_path, header, body, match):
    d = adapter_dir(tmp_path / "a")
    _st(d / "adapter_model.safetensors", header, body)
    with pytest.raises(llamax.PeftError, match=match):
        peft.convert(d, base, tmp_path / "out.gguf")


def test_a_safetensors_header_size_past_the_end_is_refused(base, tmp_path):
    d = adapter_dir(tmp_path / "a")
    (d / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    with pytest.raises(llamax.PeftError, match="not a safetensors file"):
        peft.convert(d, base, tmp_path / "out.gguf")
