"""``python -m llamax``: the demo, the benchmarks and the server."""
from __future__ import annotations

import argparse
import sys
import time


def _demo(args) -> int:
    from pathlib import Path

    import llamax
    from llamax import gguf_tools
    from llamax.models import cache_dir, default_model

    print("llamax demo: one base model, three users, per-request adapters\n")
    path = args.model or default_model(progress=True)
    print(f"model: {path}")
    out = cache_dir() / "demo"
    out.mkdir(parents=True, exist_ok=True)
    bundled = Path(llamax.__file__).resolve().parent / "data" / "adapters"
    if args.model is None:
        print("adapters: two trained for SmolLM2-135M-Instruct, shipped with llamax (tools/train_adapters.py):\n"
              "  'shout' answers in capital letters, 'json' answers as {\"answer\": ...}")
        first, second = ("shout", bundled / "shout.gguf"), ("json", bundled / "json.gguf")
    else:
        print("adapters: the bundled trained ones are for SmolLM2-135M-Instruct; for another model this demo\n"
              "  makes two seeded random ones with llamax.gguf_tools (they change the output, trained for nothing)")
        first = ("shout", gguf_tools.make_lora(path, out / "random1.gguf", rank=8, seed=1, std=0.05))
        second = ("json", gguf_tools.make_lora(path, out / "random2.gguf", rank=8, seed=2, std=0.05))

    llm = llamax.Llama(model_path=str(path), n_ctx=2048, n_threads=args.threads)
    llm.load_lora(*first)
    llm.load_lora(*second)
    users = [
        ("A", "Tell me about the moon.", [{"name": "shout", "scale": 1.0}]),
        ("B", "What is tea?", [{"name": "json", "scale": 1.0}]),
        ("C", "What is the capital of Japan?", None),
    ]
    answers = {}
    for who, question, loras in users:
        t0 = time.perf_counter()
        r = llm.create_chat_completion(messages=[{"role": "user", "content": question}],
                                       active_loras=loras, max_tokens=args.max_tokens, temperature=0.0)
        dt = time.perf_counter() - t0
        n = r["usage"]["completion_tokens"]
        answers[who] = r["choices"][0]["message"]["content"]
        label = ", ".join(f"{d['name']}@{d['scale']}" for d in loras) if loras else "none (base model)"
        print(f"\nuser {who}: {question}\n  adapters: {label}\n  {n} tokens in {dt:.2f} s "
              f"({n / dt:.1f} tok/s incl. prompt)\n  answer: {answers[who]!r}")
        letters = [ch for ch in answers[who] if ch.isalpha()]
        upper = sum(ch.isupper() for ch in letters) / max(1, len(letters))
        as_json = "yes" if answers[who].lstrip().startswith('{"answer":') else "no"
        print(f"  capital letters: {upper:.0%}; starts as {{\"answer\": ...}}: {as_json}")

    # what a swap costs: the set_adapters call, and the graph re-reserve it causes
    ad = [llamax.LoraAdapter(llm.model, p) for _, p in (first, second)]
    with llamax.Context(llm.model, n_ctx=256, n_threads=args.threads) as c:
        c.decode([1])
        n = 50
        t0 = time.perf_counter()
        for i in range(n):
            c.set_adapters([(ad[i % 2], 1.0)])
        call_us = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for i in range(n):
            c.set_adapters([(ad[0], 1.0)])
        same_us = (time.perf_counter() - t0) / n * 1e6
        c.set_adapters([])
    for a in ad:
        a.close()
    print(f"\nadapter-set swap: {call_us:.1f} µs per call (llama.cpp re-reserves its graph at the next "
          f"decode); the same set again: {same_us:.2f} µs (a no-op)")

    llm.close()
    fresh = llamax.Llama(model_path=str(path), n_ctx=2048, n_threads=args.threads)
    ref = fresh.create_chat_completion(messages=[{"role": "user", "content": users[2][1]}],
                                       max_tokens=args.max_tokens, temperature=0.0)["choices"][0]["message"]["content"]
    fresh.close()
    same = ref == answers["C"]
    print(f"\nuser C's answer equals a fresh base model's answer: {'yes' if same else 'NO'}")
    return 0 if same else 1


def _bench(args) -> int:
    """Run the benchmark scripts of a llamax checkout (they build llama-bench and
    llama-cpp-python from the pinned source, so they need the repository)."""
    import os
    import subprocess
    from pathlib import Path

    import llamax
    candidates = [Path(args.repo)] if args.repo else [Path.cwd(), Path(llamax.__file__).resolve().parent.parent]
    repo = next((c for c in candidates if (c / "benchmarks" / "bench_engine.py").exists()), None)
    if repo is None:
        print("python -m llamax bench runs from a llamax checkout (or pass --repo PATH)", file=sys.stderr)
        return 2
    extra = []
    if args.model:
        extra += ["--model", args.model]
    extra += ["--threads", str(args.threads), "--runs", str(args.runs)] + (["--quick"] if args.quick else [])
    # the scripts import the checkout's dev helpers (tools/llamax_dev), which an
    # editable install provides and a wheel does not
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(repo / "tools"), os.environ.get("PYTHONPATH", "")) if p))
    rc = subprocess.call([sys.executable, str(repo / "benchmarks" / "bench_engine.py")] + extra, cwd=str(repo),
                         env=env)
    serving = extra + (["--peers"] if args.peers else [])
    rc |= subprocess.call([sys.executable, str(repo / "benchmarks" / "bench_serving.py")] + serving,
                          cwd=str(repo), env=env)
    # embeddings: all-MiniLM-L6-v2, its own model (--model is for the generative runs)
    emb = ["--threads", str(args.threads), "--runs", str(args.runs), "--scale", "0.5"] \
        + (["--quick"] if args.quick else []) \
        + ([] if args.peers else ["--no-peers"])
    rc |= subprocess.call([sys.executable, str(repo / "benchmarks" / "bench_embeddings.py")] + emb,
                          cwd=str(repo), env=env)
    return rc


def _convert_lora(args) -> int:
    from llamax import peft
    try:
        out = peft.convert(args.peft_dir, args.base, args.output, dtype=args.dtype)
    except peft.PeftError as e:
        print(f"python -m llamax convert-lora: {e}", file=sys.stderr)
        return 2
    print(f"llamax: wrote {out} ({out.stat().st_size} bytes)")
    return 0


def _tenant_key(args) -> int:
    from llamax.server.tenants import hash_key, new_key
    if args.hash is None:
        key = new_key()
        print(f"key:  {key}\nhash: {hash_key(key)}\n(give the key to the tenant; put the hash in its 'keys')")
        return 0
    key = sys.stdin.readline().rstrip("\r\n") if args.hash == "-" else args.hash
    if not key:
        print("python -m llamax tenant-key --hash: the key is empty", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["as-llama-cpp"]:  # (the rest is the program's own command line: argparse stays out of it)
        from llamax import as_llama_cpp
        return as_llama_cpp.main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m llamax", description="llamax command line")
    sub = p.add_subparsers(dest="cmd", metavar="command")
    d = sub.add_parser("demo", help="three users, one model, per-request LoRA adapters")
    d.add_argument("--model", help="a GGUF model (default: SmolLM2-135M-Instruct, fetched and cached)")
    d.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    d.add_argument("--max-tokens", type=int, default=48)
    b = sub.add_parser("bench", help="benchmarks against llama-bench and llama-cpp-python (from a checkout)")
    b.add_argument("--model", help="a GGUF model (default: SmolLM2-135M-Instruct)")
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--runs", type=int, default=5)
    b.add_argument("--quick", action="store_true", help="fewer runs, for a smoke check")
    b.add_argument("--peers", action="store_true",
                   help="also run llama-cpp-python 0.3.36 built from the same sdist and CPU flags (cached venv) "
                        "and, for embeddings, sentence-transformers (torch 2.13.0 CPU, cached venv)")
    b.add_argument("--repo", help="the llamax checkout (default: the current folder)")
    from llamax.server import cli as server_cli
    s = sub.add_parser("serve", help="an OpenAI-compatible server with per-request adapters (extra: server)",
                       description="Serve MODEL.gguf over HTTP: OpenAI's chat, completion, embedding and model "
                                   "routes, llama-server's and vLLM's adapter routes, Prometheus metrics.")
    server_cli.add_arguments(s)
    k = sub.add_parser("tenant-key", help="a new API key and the hash the tenants file stores (--hash KEY: "
                       "the hash of a key you have)")
    k.add_argument("--hash", metavar="KEY", help="print this key's hash ('-': read the key from stdin)")
    c = sub.add_parser("convert-lora", help="a PEFT LoRA adapter directory to llama.cpp's LoRA GGUF",
                       description="Convert a PEFT LoRA (adapter_config.json + adapter_model.safetensors or .bin) "
                                   "for a GGUF base model; the result loads with Llama.load_lora or --lora.")
    c.add_argument("peft_dir", help="the PEFT adapter directory")
    c.add_argument("--base", required=True, help="the GGUF base model the adapter was trained for")
    c.add_argument("-o", "--output", required=True, help="the LoRA GGUF to write")
    c.add_argument("--dtype", choices=("f32", "f16"), default="f32", help="tensor type (default f32)")
    sub.add_parser("as-llama-cpp", help="run a Python program with `import llama_cpp` meaning llamax for every "
                   "module: as-llama-cpp [--replace] (SCRIPT | -m MODULE) [ARGS...]")
    args = p.parse_args(argv)
    if args.cmd == "tenant-key":
        return _tenant_key(args)
    if args.cmd == "convert-lora":
        return _convert_lora(args)
    if args.cmd == "serve":
        return server_cli.run(args)
    if args.cmd == "demo":
        return _demo(args)
    if args.cmd == "bench":
        return _bench(args)
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
