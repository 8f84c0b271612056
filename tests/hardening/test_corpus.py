"""The bad-input corpus: every case runs in its own interpreter, so a crash
or an abort inside llama.cpp fails the case instead of the run.

Each case must end in the typed LlamaxError subclass it names, with a
message that says what to fix, leave what the caller passed unchanged, and
leave the process alive and able to go on (each case does real work after
its error).  Fuzzer finds (tools/fuzz.py) are recorded here as cases too.
"""
import os
import textwrap

import pytest

from conftest import HERE, run_py

# Slow tier (`pytest tests -m slow`; .ci/run runs it):
# the bad-input corpus, each case in its own interpreter (~1 min).
pytestmark = pytest.mark.slow

PRE = textwrap.dedent(r'''
    import copy, os, re, struct, sys
    import numpy as np
    import llamax
    from llamax import gguf_tools as gt
    from llamax_dev import data  # run_py puts tools/ on PYTHONPATH
    SMOL = str(data.smollm2())
    WORK = os.environ["CORPUS_DIR"]
    N_OK = 0

    def snap(x):
        if isinstance(x, np.ndarray):
            return ("nd", x.dtype.str, x.shape, x.tobytes())
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, [snap(v) for v in x])
        if isinstance(x, dict):
            return ("dict", [(snap(k), snap(v)) for k, v in x.items()])
        if isinstance(x, (bytes, bytearray, str, int, float, bool, type(None))):
            return ("v", type(x).__name__, bytes(x) if isinstance(x, bytearray) else x)
        return ("id", id(x))

    def check(exc, pattern, fn, *args, **kw):
        """fn(*args, **kw) must raise exc (a LlamaxError subclass) matching pattern,
        without changing its arguments."""
        global N_OK
        before = snap((args, kw))
        try:
            fn(*args, **kw)
        except exc as e:
            assert isinstance(e, llamax.LlamaxError), f"{type(e).__name__} is not a LlamaxError: {e}"
            assert re.search(pattern, str(e)), f"message {str(e)!r} does not match {pattern!r}"
            assert snap((args, kw)) == before, "the call changed the arguments it was given"
            N_OK += 1
            return e
        except BaseException as e:
            raise AssertionError(f"expected {exc}, got {type(e).__name__}: {e}") from e
        raise AssertionError(f"expected {exc}, but nothing was raised")

    def u32(x): return struct.pack("<I", x)
    def u64(x): return struct.pack("<Q", x)
    def gstr(s):
        b = s.encode() if isinstance(s, str) else s
        return u64(len(b)) + b
    def header(n_tensors, n_kv, version=3, magic=b"GGUF"):
        return magic + u32(version) + u64(n_tensors) + u64(n_kv)
    def kv_str(key, val): return gstr(key) + u32(8) + gstr(val)
    def kv_u32(key, v): return gstr(key) + u32(4) + u32(v)
    def tinfo(name, dims, ggml_type=0, offset=0):
        return gstr(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(ggml_type) + u64(offset)
    def write(name, data):
        p = os.path.join(WORK, name)
        with open(p, "wb") as f:
            f.write(data)
        return p
    def arch_kv():
        return kv_str("general.architecture", "llama")

    def alive():
        # the process goes on: a real model loads and runs after the error
        with llamax.Model(SMOL) as m, llamax.Context(m, n_ctx=64, n_threads=1) as c:
            out, _ = c.generate(m.tokenize("Hi"), llamax.Sampler(m), max_tokens=2)
            assert len(out) == 2
        print(f"CASE-OK {N_OK}")
''')

_LOAD = "check(llamax.{exc}, {pat!r}, llamax.Model, {path})\n"

CASES = {
    # -- GGUF files --------------------------------------------------------------------------
    "gguf_empty_file": 'check(llamax.InvalidGGUFError, "empty|GGUF", llamax.Model, write("e.gguf", b""))',
    "gguf_37_bytes_empty_key": '''
        p = write("k.gguf", header(0, 1) + gstr("") + u32(0) + b"\\x01")
        assert os.path.getsize(p) == 37
        check(llamax.InvalidGGUFError, "GGUF|gguf|load", llamax.Model, p)''',
    "gguf_bad_magic": 'check(llamax.InvalidGGUFError, "magic|GGUF", llamax.Model, write("m.gguf", b"GGUX" + bytes(60)))',
    "gguf_bad_version_0": 'check(llamax.InvalidGGUFError, "GGUF|version|load", llamax.Model, write("v0.gguf", header(0, 0, version=0)))',
    "gguf_bad_version_huge": '''
        check(llamax.InvalidGGUFError, "GGUF|version|load", llamax.Model, write("vh.gguf", header(0, 0, version=0xFFFFFFFF)))''',
    "gguf_truncated_at_offsets": '''
        raw = open(SMOL, "rb").read(1 << 21)
        for cut in (3, 4, 8, 16, 24, 100, 1000, 4096, 1 << 20, (1 << 21) - 1):
            check(llamax.InvalidGGUFError, "GGUF|gguf|load|truncat", llamax.Model, write(f"t{cut}.gguf", raw[:cut]))''',
    "gguf_truncated_data": '''
        # a complete header whose tensor data stops short
        size = os.path.getsize(SMOL)
        with open(SMOL, "rb") as f:
            p = write("td.gguf", f.read(size - 4096))
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|data|size", llamax.Model, p)''',
    "gguf_huge_tensor_count": '''
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|tensor", llamax.Model, write("ht.gguf", header(2**63 - 1, 0)))''',
    "gguf_huge_kv_count": '''
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|key", llamax.Model, write("hk.gguf", header(0, 2**62)))''',
    "gguf_huge_string_length": '''
        check(llamax.InvalidGGUFError, "GGUF|gguf|load", llamax.Model,
              write("hs.gguf", header(0, 1) + u64(2**62) + b"general.architecture"))
        check(llamax.InvalidGGUFError, "GGUF|gguf|load", llamax.Model,
              write("hs2.gguf", header(0, 1) + gstr("general.architecture") + u32(8) + u64(2**63 - 5) + b"llama"))''',
    "gguf_huge_array_length": '''
        body = gstr("tokenizer.ggml.tokens") + u32(9) + u32(8) + u64(2**61) + gstr("a")
        check(llamax.InvalidGGUFError, "GGUF|gguf|load", llamax.Model, write("ha.gguf", header(0, 1) + body))''',
    "gguf_tensor_dim_zero": '''
        body = arch_kv() + tinfo("token_embd.weight", [0, 8]) 
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|tensor", llamax.Model, write("d0.gguf", header(1, 1) + body + bytes(64)))''',
    "gguf_tensor_dims_overflow": '''
        body = arch_kv() + tinfo("token_embd.weight", [2**40, 2**40])
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|tensor", llamax.Model, write("dov.gguf", header(1, 1) + body + bytes(64)))''',
    "gguf_tensor_too_many_dims": '''
        body = arch_kv() + tinfo("token_embd.weight", [1] * 9)
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|tensor", llamax.Model, write("d9.gguf", header(1, 1) + body + bytes(64)))''',
    "gguf_bad_tensor_type": '''
        body = arch_kv() + tinfo("token_embd.weight", [8, 8], ggml_type=1000)
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|type", llamax.Model, write("bt.gguf", header(1, 1) + body + bytes(512)))''',
    "gguf_misaligned_offset": '''
        body = arch_kv() + tinfo("token_embd.weight", [8, 8], offset=3)
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|align|offset", llamax.Model, write("mo.gguf", header(1, 1) + body + bytes(512)))''',
    "gguf_offset_past_end": '''
        body = arch_kv() + tinfo("token_embd.weight", [8, 8], offset=2**40)
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|offset|data", llamax.Model, write("pe.gguf", header(1, 1) + body + bytes(512)))''',
    "gguf_bad_kv_type": '''
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|type", llamax.Model,
              write("kt.gguf", header(0, 1) + gstr("general.architecture") + u32(999) + u32(0)))''',
    "gguf_duplicate_key": '''
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|duplicate", llamax.Model,
              write("dk.gguf", header(0, 2) + arch_kv() + arch_kv()))''',
    "gguf_valid_header_no_tensors": '''
        check(llamax.InvalidGGUFError, "GGUF|gguf|load|tensor|architecture|model", llamax.Model,
              write("nt.gguf", header(0, 1) + arch_kv()))''',
    "gguf_unknown_architecture": '''
        check(llamax.InvalidGGUFError, "architecture|load", llamax.Model,
              write("ua.gguf", header(0, 1) + kv_str("general.architecture", "no-such-arch")))''',
    "load_directory": 'check(llamax.LoadError, "directory", llamax.Model, WORK)',
    "load_missing_file": 'check(llamax.LoadError, "(?i)no such file|does not exist|not found", llamax.Model, os.path.join(WORK, "missing.gguf"))',
    "load_no_read_permission": '''
        p = write("noperm.gguf", open(SMOL, "rb").read(4096))
        os.chmod(p, 0)
        root = os.geteuid() == 0
        if root:
            os.seteuid(65534)  # root reads anything: check as nobody
        try:
            check(llamax.LoadError, "(?i)permission|readable", llamax.Model, p)
        finally:
            if root:
                os.seteuid(0)''',
    "load_path_with_nul": 'check(llamax.InvalidArgumentError, "NUL", llamax.Model, "a\\0b.gguf")',
    # -- LoRA adapters ---------------------------------------------------------------------------
    "lora_other_architecture": '''
        p = gt.make_lora(SMOL, os.path.join(WORK, "arch.gguf"), rank=2, arch="gpt2")
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            check(llamax.AdapterMismatchError, "architecture|arch", llm.load_lora, "x", p)''',
    "lora_other_shapes": '''
        p = gt.make_lora(SMOL, os.path.join(WORK, "shape.gguf"), rank=2, shape_offset=3)
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            check(llamax.AdapterMismatchError, "shape|tensor|lora", llm.load_lora, "x", p)''',
    "lora_missing_b": '''
        p = gt.make_lora(SMOL, os.path.join(WORK, "nob.gguf"), rank=2, drop_b=True)
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            check(llamax.AdapterMismatchError, "lora_b|lora|tensor", llm.load_lora, "x", p)''',
    "lora_not_an_adapter": '''
        p = gt.make_lora(SMOL, os.path.join(WORK, "type.gguf"), rank=2, general_type="model")
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            check(llamax.AdapterMismatchError, "adapter|type", llm.load_lora, "x", p)''',
    "lora_model_file_as_adapter": '''
        m = llamax.Model(SMOL)
        check(llamax.AdapterMismatchError, "adapter|type|lora", llamax.LoraAdapter, m, SMOL)
        m.close()''',
    "lora_garbage_file": '''
        m = llamax.Model(SMOL)
        check(llamax.InvalidGGUFError, "GGUF|magic", llamax.LoraAdapter, m, write("g.gguf", b"not a gguf at all" * 10))
        m.close()''',
    "lora_bad_names_and_scales": '''
        p = gt.make_lora(SMOL, os.path.join(WORK, "ok.gguf"), rank=2)
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            llm.load_lora("ok", p)
            check(llamax.UnknownAdapterError, "nope", llm.create_completion, "x", max_tokens=1,
                  active_loras=[{"name": "nope", "scale": 1.0}])
            check(llamax.InvalidArgumentError, "scale", llm.create_completion, "x", max_tokens=1,
                  active_loras=[{"name": "ok", "scale": float("nan")}])
            check(llamax.ArgumentTypeError, "active_loras", llm.create_completion, "x", max_tokens=1,
                  active_loras="ok")
            check(llamax.InvalidArgumentError, "already|loaded", llm.load_lora, "ok", p)''',
    # -- control vectors ---------------------------------------------------------------------------
    "cvec_wrong_n_embd": '''
        m = llamax.Model(SMOL)
        rows = np.ones((3, m.n_embd + 1), np.float32)
        check(llamax.ControlVectorError, "n_embd|floats|length", llamax.ControlVector.from_rows, m, rows, 1, 3)
        p = gt.make_control_vector(os.path.join(WORK, "cv.gguf"), n_embd=m.n_embd + 7, layers=range(1, 4))
        check(llamax.ControlVectorError, "n_embd", llamax.ControlVector.load, m, p)
        m.close()''',
    "cvec_inverted_range": '''
        m = llamax.Model(SMOL)
        check(llamax.ControlVectorError, "layer", llamax.ControlVector.from_rows, m, np.ones((3, m.n_embd), np.float32), 5, 3)
        m.close()''',
    "cvec_out_of_range": '''
        m = llamax.Model(SMOL)
        n = m.n_layer
        check(llamax.ControlVectorError, "layer", llamax.ControlVector.from_rows, m, np.ones((2, m.n_embd), np.float32), n, n + 1)
        check(llamax.ControlVectorError, "layer", llamax.ControlVector.from_rows, m, np.ones((1, m.n_embd), np.float32), 0, 0)
        check(llamax.ControlVectorError, "layer", llamax.ControlVector.from_rows, m, np.ones((1, m.n_embd), np.float32), -5, -5)
        m.close()''',
    "cvec_nan_inf": '''
        m = llamax.Model(SMOL)
        for bad in (np.nan, np.inf, -np.inf):
            rows = np.zeros((2, m.n_embd), np.float32); rows[1, 7] = bad
            check(llamax.ControlVectorError, "finite|NaN|inf", llamax.ControlVector.from_rows, m, rows, 1, 2)
        m.close()''',
    "cvec_too_short": '''
        m = llamax.Model(SMOL)
        check(llamax.ControlVectorError, "floats|length|short", llamax.ControlVector.from_padded, m, np.ones(m.n_embd * 2, np.float32), 1, 5)
        check(llamax.ControlVectorError, "floats|length|rows", llamax.ControlVector.from_rows, m, np.ones(m.n_embd * 2 - 1, np.float32), 1, 2)
        m.close()''',
    "cvec_llama_dict_errors": '''
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            n = llm.n_embd()
            data = np.ones(n * 4, np.float32)
            check(llamax.ControlVectorError, "layer", llm.create_completion, "x", max_tokens=1,
                  control_vector={"data": data, "layer_start": 1, "layer_end": 999})
            check(llamax.ControlVectorError, "floats|length|short", llm.create_completion, "x", max_tokens=1,
                  control_vector={"data": data[:-1], "layer_start": 1, "layer_end": 4})
            check(llamax.ControlVectorError, "needs 'data'", llm.create_completion, "x", max_tokens=1,
                  control_vector={"layer_start": 1, "layer_end": 4})
            check(llamax.ArgumentTypeError, "unknown keys", llm.create_completion, "x", max_tokens=1,
                  control_vector={"data": data, "layer_start": 1, "layer_end": 4, "scale": 2})
            check(llamax.UnknownAdapterError, "nope|control", llm.create_completion, "x", max_tokens=1,
                  control_vectors=[{"name": "nope", "scale": 1.0}])''',
    # -- tokens and prompts ---------------------------------------------------------------------------
    "token_ids_out_of_range": '''
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_ctx=64, n_threads=1)
        for bad in (-1, m.n_vocab, 2**31 - 1):
            check(llamax.TokenError, "out of range|token", c.decode, np.array([1, bad], np.int32))
            check(llamax.TokenError, "out of range|token", m.detokenize, [bad])
            check(llamax.TokenError, "out of range|token", m.token_to_piece, bad)
            check(llamax.TokenError, "out of range|token", c.generate, [bad], llamax.Sampler(m))
        check(llamax.TokenError, "int32|token", c.decode, [2**40])
        c.close(); m.close()''',
    "token_ids_in_llama_api": '''
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            for bad in ([-1], [llm.n_vocab()], [2**31 - 1], [1, 2**40]):
                check(llamax.TokenError, "out of range|token|int32", llm.create_completion, bad, max_tokens=1)
            check(llamax.TokenError, "out of range|token", llm.detokenize, [llm.n_vocab()])''',
    "empty_prompt_engine": '''
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_ctx=64, n_threads=1)
        check(llamax.InvalidArgumentError, "empty", c.generate, [], llamax.Sampler(m))
        check(llamax.InvalidArgumentError, "empty", c.decode, [])
        c.close(); m.close()''',
    "prompt_longer_than_n_ctx": '''
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            long = "word " * 200
            check(llamax.ContextOverflowError, "n_ctx|context", llm.create_completion, long, max_tokens=4)
            check(llamax.ContextOverflowError, "n_ctx|context", llm.create_chat_completion,
                  [{"role": "user", "content": long}], max_tokens=4)
            check(llamax.ContextOverflowError, "n_ctx|truncate", llm.create_embedding, long, truncate=False)''',
    "generation_runs_out_of_context": '''
        with llamax.Llama(SMOL, n_ctx=48, n_threads=1) as llm:
            r = llm.create_completion("Once upon a time", max_tokens=500, temperature=0.0, top_k=1)
            assert r["choices"][0]["finish_reason"] == "length", r
            n = r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
            assert n <= 48 + 1, n  # the last sampled token needs no KV slot
            # greedy like the call above: llama-cpp-python's default temperature (0.8) may end on EOS
            chunks = list(llm.create_completion("Once upon a time", max_tokens=500, stream=True,
                                                temperature=0.0, top_k=1))
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            N_OK += 1''',
    "invalid_utf8": '''
        m = llamax.Model(SMOL)
        check(llamax.InvalidUtf8Error, "UTF-8", m.tokenize, b"ok \\xff\\xfe bad")
        check(llamax.InvalidUtf8Error, "UTF-8|surrogate", m.tokenize, "lone \\ud800 surrogate")
        def decodes(b):
            try:
                b.decode("utf-8"); return True
            except UnicodeDecodeError:
                return False
        partial = next(t for t in range(m.n_vocab) if not decodes(m.token_to_piece(t)))
        check(llamax.InvalidUtf8Error, "UTF-8", m.detokenize_text, [partial], errors="strict")
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            check(llamax.InvalidUtf8Error, "UTF-8", llm.create_completion, b"\\xc3\\x28", max_tokens=1)
            check(llamax.InvalidUtf8Error, "UTF-8|surrogate", llm.create_chat_completion,
                  [{"role": "user", "content": "\\udcff"}], max_tokens=1)
        m.close()''',
    # -- chat templates ----------------------------------------------------------------------------------
    "template_hostile": '''
        from llamax import ChatTemplate, ChatTemplateError
        msgs = [{"role": "user", "content": "hi"}]
        bad = {
            "ssti": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
            "globals": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
            "loop": "{% for i in range(10**9) %}{{ i }}{% endfor %}",
            "bomb": "{{ 'x' * 10**10 }}",
            "pow": "{{ 2 ** 100000000 }}",
            "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            "raise": "{{ raise_exception('nope') }}",
            "syntax": "{% if %}",
            "undefined_call": "{{ nothing() }}",
        }
        for name, src in bad.items():
            def render(src=src):
                ChatTemplate(src).render(msgs, add_generation_prompt=True)
            check(ChatTemplateError, "template", render)
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1, chat_template=bad["ssti"]) as llm:
            check(ChatTemplateError, "template", llm.create_chat_completion, msgs, max_tokens=1)''',
    "chat_messages_malformed": '''
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            check(llamax.InvalidArgumentError, "messages", llm.create_chat_completion, [])
            check(llamax.ArgumentTypeError, "messages", llm.create_chat_completion, ["hi"])
            check(llamax.InvalidArgumentError, "role", llm.create_chat_completion, [{"content": "hi"}])
            check(llamax.InvalidArgumentError, "content", llm.create_chat_completion, [{"role": "user", "content": 3}])
            check(llamax.InvalidArgumentError, "prefill|assistant", llm.create_chat_completion,
                  [{"role": "user", "content": "hi"}], assistant_prefill=True)''',
    # -- wrong types, public arguments ------------------------------------------------------------------------
    "types_model_and_context": '''
        check(llamax.ArgumentTypeError, "path", llamax.Model, 42)
        check(llamax.ArgumentTypeError, "n_gpu_layers", llamax.Model, SMOL, n_gpu_layers="all")
        m = llamax.Model(SMOL)
        for kw in ({"n_ctx": "512"}, {"n_batch": 1.5}, {"n_threads": True}, {"n_seq_max": None},
                   {"n_ubatch": [1]}, {"n_threads_batch": "2"}):
            check(llamax.ArgumentTypeError, list(kw)[0], llamax.Context, m, **kw)
        check(llamax.ArgumentTypeError, "model", llamax.Context, "not a model")
        check(llamax.ArgumentTypeError, "model", llamax.Sampler, None)
        c = llamax.Context(m, n_ctx=64, n_threads=1)
        check(llamax.ArgumentTypeError, "tokens", c.decode, "text")
        check(llamax.ArgumentTypeError, "tokens", c.decode, [1.5, 2.5])
        check(llamax.ArgumentTypeError, "sampler", c.generate, [1], "greedy")
        check(llamax.ArgumentTypeError, "max_tokens", c.generate, [1], llamax.Sampler(m), max_tokens="8")
        check(llamax.ArgumentTypeError, "seq_id", c.get_embeddings_seq, "0")
        check(llamax.ArgumentTypeError, "token", m.token_to_piece, "a")
        check(llamax.ArgumentTypeError, "text", m.tokenize, 123)
        check(llamax.ArgumentTypeError, "seq_id", c.kv_remove, "0")
        check(llamax.ArgumentTypeError, "ctx", llamax.Sampler(m).sample, "ctx")
        check(llamax.ArgumentTypeError, "callback", c.generate, [1], llamax.Sampler(m), callback=3)
        check(llamax.ArgumentTypeError, "layer_start", llamax.ControlVector.from_rows, m, np.ones(m.n_embd, np.float32), "1", 1)
        check(llamax.ArgumentTypeError, "rows", llamax.ControlVector.from_rows, m, "rows", 1, 1)
        check(llamax.ArgumentTypeError, "scale", llamax.ControlVector.load, m, SMOL, scale="1")
        check(llamax.ArgumentTypeError, "set_adapters|LoraAdapter", c.set_adapters, ["x"])
        c.close(); m.close()''',
    "types_sampler": '''
        m = llamax.Model(SMOL)
        for kw in ({"temperature": "hot"}, {"top_k": 1.5}, {"top_p": None}, {"seed": "7"},
                   {"grammar": 42}, {"logit_bias": [1, 2]}, {"repeat_penalty": "x"}):
            check(llamax.ArgumentTypeError, ".", llamax.Sampler, m, **kw)
        check(llamax.InvalidArgumentError, "temperature|finite", llamax.Sampler, m, temperature=float("nan"))
        check(llamax.GrammarError, "grammar", llamax.Sampler, m, grammar="root ::= (")
        m.close()''',
    "types_llama_completion": '''
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            bad = {"max_tokens": "16", "temperature": "0.1", "top_p": [1], "top_k": 2.5, "stop": 5,
                   "seed": "1", "logprobs": "3", "stream": None, "logit_bias": "x", "grammar": 7,
                   "active_loras": 3, "control_vector": "happy", "control_vectors": 5, "cancel": True,
                   "repeat_penalty": "1", "min_p": {}, "typical_p": b"1", "presence_penalty": "0",
                   "frequency_penalty": [0]}
            for k, v in bad.items():
                def call(k=k, v=v):
                    r = llm.create_completion("Hi", **{"max_tokens": 1, k: v})
                    if k == "stream":
                        list(r)
                check((llamax.ArgumentTypeError, llamax.InvalidArgumentError), ".", call)
            check(llamax.ArgumentTypeError, "prompt", llm.create_completion, 3.14)
            check(llamax.ArgumentTypeError, "input", llm.create_embedding, 42)''',
    "types_llama_constructor": '''
        for kw in ({"n_ctx": "512"}, {"n_threads": "2"}, {"seed": "1"}, {"n_contexts": 1.0},
                   {"max_loaded_adapters": "3"}, {"chat_template": 5}):
            check((llamax.ArgumentTypeError, llamax.InvalidArgumentError), ".", llamax.Llama, SMOL, **kw)
        check(llamax.LoadError, "x.gguf", llamax.Llama, SMOL, lora_path="x.gguf")
        for kw, what in (({"lora_path": 5}, "lora_path"), ({"type_k": [8]}, "type_k"), ({"kv_overrides": "a=1"},
                         "kv_overrides"), ({"tensor_split": 1.0}, "tensor_split"), ({"tokenizer": "hf"}, "tokenizer"),
                         ({"use_mlock": "yes"}, "use_mlock"), ({"rope_freq_base": "1e4"}, "rope_freq_base")):
            check(llamax.ArgumentTypeError, what, llamax.Llama, SMOL, **kw)
        check(llamax.ArgumentTypeError, "path", llamax.Llama, None)''',
    "types_embedder": '''
        e = llamax.Embedder(SMOL, n_ctx=64, n_threads=1)
        check(llamax.ArgumentTypeError, "sentences", e.encode, 42)
        check(llamax.ArgumentTypeError, "sentences", e.encode, [b"bytes"])
        check(llamax.InvalidArgumentError, "batch_size", e.encode, ["x"], batch_size=0)
        check(llamax.InvalidArgumentError, "max_seq_length", setattr, e, "max_seq_length", 0)
        e.close()''',
    "closed_objects": '''
        m = llamax.Model(SMOL)
        c = llamax.Context(m, n_ctx=64, n_threads=1)
        c.close()
        check(llamax.ClosedError, "closed", c.decode, [1])
        m.close()
        check(llamax.ClosedError, "closed", m.tokenize, "x")
        llm = llamax.Llama(SMOL, n_ctx=64, n_threads=1); llm.close()
        check(llamax.ClosedError, "closed", llm.create_completion, "x")''',
    # -- fuzzer finds (tools/fuzz.py), kept as reproducers ------------------------------------------------
    "fuzz_cvec_huge_tensor_abort": '''
        # a LoRA-like GGUF whose tensor header claims a huge size: loading it as a
        # control vector made gguf allocate the data and ggml_init abort the process
        p = os.path.join(TESTS, "hardening", "fuzz_finds", "cvec-huge-tensor-abort.gguf")
        m = llamax.Model(SMOL)
        check((llamax.ControlVectorError, llamax.InvalidGGUFError), "direction|GGUF", llamax.ControlVector.load, m, p)
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            check((llamax.ControlVectorError, llamax.InvalidGGUFError), "direction|GGUF", llm.load_control_vector, "x", p)
            check(llamax.AdapterMismatchError, "adapter|lora", llm.load_lora, "x", p)
        m.close()''',
    "fuzz_vocab_duplicate_token_abort": '''
        # a vocabulary that lists one token string twice: llama.cpp's vocab loader
        # asserts (aborts) on it; llamax checks the metadata first
        p = os.path.join(TESTS, "hardening", "fuzz_finds", "vocab-duplicate-token-abort.gguf")
        check(llamax.InvalidGGUFError, "twice", llamax.Model, p)
        check(llamax.InvalidGGUFError, "twice", llamax.Model, p, vocab_only=True)
        check(llamax.InvalidGGUFError, "twice", llamax.Llama, p)''',
    "fuzz_lora_invalid_utf8_message": '''
        # llama.cpp's error quotes a tensor name with invalid UTF-8: the message must
        # still become the typed error (decoded with replacement), not UnicodeDecodeError
        p = os.path.join(TESTS, "hardening", "fuzz_finds", "lora-invalid-utf8-message.gguf")
        m = llamax.Model(SMOL)
        check(llamax.AdapterMismatchError, "suffix|lora", llamax.LoraAdapter, m, p)
        m.close()''',
    "fuzz_lora_alpha_wrong_type_abort": '''
        # adapter.lora.alpha stored as another type: llama.cpp's adapter loader reads
        # it with gguf_get_val_f32, which asserts (aborts) on the type
        p = os.path.join(TESTS, "hardening", "fuzz_finds", "lora-alpha-wrong-type-abort.gguf")
        with llamax.Llama(SMOL, n_ctx=64, n_threads=1) as llm:
            check(llamax.InvalidGGUFError, "adapter.lora.alpha' has type", llm.load_lora, "x", p)
        # the same for the other keys it reads
        bad = header(0, 3) + kv_str("general.type", "adapter") + kv_str("adapter.type", "lora") \
            + gstr("general.architecture") + u32(4) + u32(7)
        m = llamax.Model(SMOL)
        check(llamax.InvalidGGUFError, "general.architecture' has type", llamax.LoraAdapter, m, write("la.gguf", bad))
        m.close()''',
    "context_params_out_of_range": '''
        m = llamax.Model(SMOL)
        for kw in ({"n_ctx": -1}, {"n_batch": 0}, {"n_seq_max": 10**6}, {"n_threads": 0}, {"pooling": "max"}):
            check(llamax.InvalidArgumentError, ".", llamax.Context, m, **kw)
        m.close()''',
}


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    os.chmod(d, 0o777)  # the permission case drops to nobody and must still see it
    os.chmod(d.parent, 0o755)
    return d


def test_corpus_is_large_enough():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name, corpus_dir, smollm2_path):
    code = (PRE + textwrap.dedent(CASES[name]).strip("\n") + "\nalive()\n").replace("TESTS", repr(str(HERE)))
    env_dir = str(corpus_dir)
    r = run_py(f"import os; os.environ['CORPUS_DIR'] = {env_dir!r}\n" + code, timeout=300)
    assert r.returncode == 0, f"case {name} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    assert "CASE-OK" in r.stdout, r.stdout
    n_ok = int(r.stdout.rsplit("CASE-OK", 1)[1].split()[0])
    assert n_ok >= 1, f"case {name} checked nothing"
