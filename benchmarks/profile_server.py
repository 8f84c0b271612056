"""Where a server's time goes under bench_server.py's load: the CPU time of
each of its threads, and optionally a py-spy or perf profile of it.

  python3 benchmarks/profile_server.py [--target llamax|llama-server]
        [--mode one|many|base] [--clients 8] [--profiler none|py-spy|perf]
        [-- extra server flags]

One server (llamax's, or llama-server built by server_peers.py), the same
model, adapters and requests as bench_server.py (streaming chats of 64
tokens, end tokens banned, 3 x clients requests), a warm-up, then one
measured load.  Printed: tok/s and TTFT as bench_server.py measures them,
and per thread the CPU seconds of the run and per generated token (from
/proc/PID/task/*/stat): the event loop's share against ggml's threads.
``--profiler py-spy`` writes a raw py-spy profile (Python frames of every
thread, idle ones included) and ``perf`` a perf.data (no call graphs;
``perf report -i FILE --sort sym``) to benchmarks/results/profile/.
Both profilers take CPU from the 2 cores they watch: compare profiles with
each other, not their tok/s with bench_server.py's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import bench_server as B  # benchmarks/, this script's folder
import server_peers

import llamax
from llamax import gguf_tools
from llamax.models import cache_dir, default_model

OUT = Path(__file__).resolve().parent / "results" / "profile"


def thread_cpu(pid: int) -> dict[str, tuple[str, float]]:
    """tid -> (thread name, CPU seconds so far)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        f = stat.rsplit(")", 1)[1].split()
        out[tid] = ("main thread" if tid == str(pid) else name, (int(f[11]) + int(f[12])) / tick)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", choices=("llamax", "llama-server"), default="llamax")
    p.add_argument("--mode", choices=("one", "many", "base"), default="one")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--profiler", choices=("none", "py-spy", "perf"), default="none")
    p.add_argument("extra", nargs="*", help="more server flags (after --)")
    a = p.parse_args(argv)
    model = Path(default_model(progress=True))
    d = cache_dir() / "bench"
    d.mkdir(parents=True, exist_ok=True)
    coder = gguf_tools.make_lora(model, d / "srv-coder.gguf", rank=8, seed=1, std=0.05)
    writer = gguf_tools.make_lora(model, d / "srv-writer.gguf", rank=8, seed=2, std=0.05)
    many = [gguf_tools.make_lora(model, d / f"srv-many{i}.gguf", rank=8, seed=100 + i, std=0.05,
                                 targets=("attn_q", "attn_k", "attn_v", "attn_output")) for i in range(B.N_MANY)]
    m = llamax.Model(str(model), vocab_only=True)
    ban = {str(t): -100.0 for t in range(m.n_vocab) if m.is_eog(t)}
    m.close()
    port = B.free_port()
    T = str(a.threads)
    if a.target == "llamax":
        cmd = [sys.executable, "-m", "llamax", "serve", str(model), "--alias", "smol", "--port", str(port),
               "--threads", T, "--parallel", str(B.N_PAR), "--n-ctx", str(B.N_CTX), "--lora", f"coder={coder}",
               "--lora", f"writer={writer}"] + [x for i, f in enumerate(many) for x in ("--lora", f"m{i}={f}")]

        def body(i):
            loras = {"one": [{"name": "coder", "scale": 1.0}], "base": [],
                     "many": [{"name": f"m{i % B.N_MANY}", "scale": 1.0}]}[a.mode]
            return {"model": "smol", "logit_bias": ban, "active_loras": loras}
    else:
        cmd = [str(server_peers.llama_server()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "-t", T, "-tb", T, "-np", str(B.N_PAR), "-c", str(B.N_PAR * B.N_CTX), "--lora", str(coder),
               "--lora", str(writer)] + [x for f in many for x in ("--lora", str(f))] + ["--lora-init-without-apply"]

        def body(i):
            if a.mode == "many":
                return {"logit_bias": ban, "lora": [{"id": 2 + i % B.N_MANY, "scale": 1.0}]}
            if a.mode == "base":
                return {"logit_bias": ban}
            return {"logit_bias": ban, "lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.0}]}
    srv = B.Contestant(f"profile-{a.target}", cmd + a.extra, port, body, [a.mode])
    OUT.mkdir(parents=True, exist_ok=True)
    stem = OUT / f"{a.target}-{a.mode}-{a.clients}"
    prof = None
    try:
        asyncio.run(B.load(srv.url, 2, 2, body, 8))  # warm-up
        if a.profiler == "py-spy":
            prof = subprocess.Popen(["py-spy", "record", "-p", str(srv.proc.pid), "-o", f"{stem}.pyspy.txt", "-f",
                                     "raw", "-r", "100", "--threads", "--idle"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        elif a.profiler == "perf":
            prof = subprocess.Popen(["perf", "record", "-F", "199", "-p", str(srv.proc.pid), "-o", f"{stem}.perf.data"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
        c0 = thread_cpu(srv.proc.pid)
        res = asyncio.run(B.load(srv.url, a.clients, max(8, 3 * a.clients), body, a.max_tokens))
        c1 = thread_cpu(srv.proc.pid)
    finally:
        if prof is not None:
            prof.send_signal(2)
            prof.wait(60)
        srv.stop()
    toks = max(1, res["requests"] * a.max_tokens)
    rows = sorted(((c1[t][1] - c0.get(t, ("", 0.0))[1], c1[t][0], t) for t in c1), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"{a.target}, {a.mode}, {a.clients} clients: {res['tok_s']:.1f} tok/s, p95 TTFT {res['ttft_p95_s']:.3f} s, "
          f"{res['n_errors']} errors")
    print(f"CPU {total:.2f} s in {res['wall_s']:.2f} s wall, {1000 * total / toks:.2f} ms per generated token")
    for sec, name, tid in rows[:8]:
        if sec > 0:
            print(f"  thread {tid:>8s} {name:18s} {sec:7.2f} s  {1000 * sec / toks:6.2f} ms/token")
    (OUT / f"{stem.name}.json").write_text(json.dumps({"result": res, "threads": rows}, indent=1))
    if prof is not None:
        print(f"profile: {stem}.{'pyspy.txt' if a.profiler == 'py-spy' else 'perf.data'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
