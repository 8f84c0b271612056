#!/usr/bin/env python3
"""Engine benchmark: llamax against llama.cpp's own llama-bench, same source, same flags.

One run measures, on SmolLM2-135M-Instruct (Q4_1) with a fixed thread count:

1. Decode throughput (tg128: 128 tokens generated one by one) and prompt
   throughput (pp512: one 512-token batch).  llama-bench and llamax are run
   in alternation (A B A B ...) after an untimed warm-up pair, so slow drift
   on a shared machine (thermal, other jobs) hits both contestants alike; the
   llamax / llama-bench ratio is taken pair by pair and its median reported.
2. Per-token overhead of llamax's generate loop: llamax time per generated
   token minus llama-bench's, per pair.  It covers everything llama-bench's
   tg loop doesn't do: greedy sampling over the vocabulary, the
   Python -> C++ call, the result copy.  The cost of one greedy sample is
   measured separately so the two can be told apart.
3. Per-call costs of state changes: a LoRA adapter-set swap and an identical
   re-apply (``Context.set_adapters``), a control-vector apply and an
   identical re-apply (``Context.set_control_vector``), and getting the
   logits view (``Context.get_logits``).  llama.cpp defers the compute-graph
   re-reserve that a state change causes to the next decode, so that
   deferred cost is measured too (first decode after a change minus a decode
   after a no-op re-apply).
4. GIL release: the rate of a pure-Python counter thread while another
   thread runs ``generate`` (128 tokens), as a fraction of its solo rate.

Usage:
    python benchmarks/bench_engine.py [--model PATH] [--threads 2] [--runs 5] [--quick]

Writes benchmarks/results/engine.json (machine, flags, every sample) and
benchmarks/results/engine.md (the table, also printed).  This is a
benchmark, not a test: it asserts nothing about speed.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

# The test data (cached, verified model) and the pinned llama.cpp build:
# llamax_dev, the repository's dev helpers, not part of the package.
from llamax_dev import data
from llamax_dev.buildsys import llama_build

import llamax

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

N_GEN = 128      # tg128
N_PROMPT = 512   # pp512
N_BATCH = 512    # llamax decodes the prompt in chunks of this size; llama-bench gets -b/-ub 512 too
pc = time.perf_counter_ns


# ---------------------------------------------------------------------------
# small statistics helpers

def med(xs):
    return statistics.median(xs) if xs else float("nan")


def summary(xs):
    """{median, min, max, n}: what the table shows, kept next to the raw samples."""
    return {"median": med(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def fmt(s, digits=1):
    if not s:
        return "n/a"
    f = f"{{:.{digits}f}}"
    return f"{f.format(s['median'])} ({f.format(s['min'])}–{f.format(s['max'])})"


# ---------------------------------------------------------------------------
# machine description

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    # Only the SIMD sets ggml's CPU backend cares about: the full list is noise.
    wanted = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw",
              "avx512_vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(wanted & set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return []


def loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def machine_info(bench_bin: Path) -> dict:
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "cpu_model": cpu_model(),
        "cpu_simd_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_impl": platform.python_implementation(),
        "numpy": np.__version__,
        "llamax": llamax.__version__,
        "llamax_system_info": llamax.system_info(),
        "llama_cpp_pin": {"llama_cpp_python_sdist": llama_build.PIN_VERSION,
                          "upstream_commit": llama_build.PIN_COMMIT,
                          "sdist_sha256": llama_build.SDIST_SHA256},
        "cmake_args": llama_build.cmake_args(),
        "llama_build_dir": str(llama_build.build_dir()),
        "llama_bench": str(bench_bin),
    }


# ---------------------------------------------------------------------------
# llama-bench

def find_llama_bench(explicit: str | None) -> Path:
    """llama-bench built from the same pinned tree and CMake flags as llamax.

    An existing binary in the cached build folder is used as is: the folder is
    keyed by the pin and every CMake argument, so it is the same build, and
    not running cmake avoids racing a concurrent build of that folder.
    """
    if explicit:
        return Path(explicit)
    exe = llama_build.build_dir() / "bin" / "llama-bench"
    if exe.is_file():
        return exe
    info = llama_build.build(["llama-bench"])  # a no-op rebuild when cached
    return Path(info["build"]) / "bin" / "llama-bench"


def run_llama_bench(exe: Path, model: Path, threads: int, extra: tuple[str, ...] = ()) -> dict:
    """One llama-bench invocation: pp512 and tg128, one repetition each.

    -r 1 so every invocation is one measured sample and the runs can be
    interleaved with llamax's; llama-bench still does its own untimed warm-up
    before each test.  -b/-ub 512 match llamax's contexts.
    """
    cmd = [str(exe), "-m", str(model), "-t", str(threads), "-r", "1", "-o", "json",
           "-p", str(N_PROMPT), "-n", str(N_GEN), "-b", str(N_BATCH), "-ub", str(N_BATCH), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({p.returncode}):\n{p.stderr[-2000:]}")
    rows = json.loads(p.stdout)
    out = {"cmd": cmd, "raw": rows}
    for r in rows:
        # samples_ts has the single sample of -r 1; avg_ts is the same number
        ts = r["samples_ts"][0] if r.get("samples_ts") else r["avg_ts"]
        if r["n_prompt"] == N_PROMPT and r["n_gen"] == 0:
            out["pp_ts"] = ts
        elif r["n_prompt"] == 0 and r["n_gen"] == N_GEN:
            out["tg_ts"] = ts
    if "pp_ts" not in out or "tg_ts" not in out:
        raise RuntimeError(f"unexpected llama-bench output: {p.stdout[:500]}")
    return out


# ---------------------------------------------------------------------------
# llamax contestant

class LlamaxRunner:
    """llamax set up like llama-bench: one context per test, n_ctx = tokens the test needs."""

    def __init__(self, model: llamax.Model, threads: int):
        self.model = model
        # llama-bench sizes its context as n_prompt + n_gen; do the same so
        # both attend over the same KV size (+1: generate counts its prompt
        # token and the 128 it returns against n_ctx, as OpenAI does, though
        # the last one is never decoded: the same 128 decodes as llama-bench)
        self.tg = llamax.Context(model, n_ctx=N_GEN + 1, n_batch=N_BATCH, n_ubatch=N_BATCH,
                                 n_threads=threads, n_threads_batch=threads)
        self.pp = llamax.Context(model, n_ctx=N_PROMPT, n_batch=N_BATCH, n_ubatch=N_BATCH,
                                 n_threads=threads, n_threads_batch=threads)
        self.sampler = llamax.Sampler(model, temperature=0.0)
        bos = model.token_bos
        # llama-bench's tg starts from BOS (or a random token); generate needs
        # at least one prompt token, so BOS is both: it costs one decode, as
        # llama-bench's first of 128.
        self.gen_prompt = np.array([bos if bos >= 0 else 0], dtype=np.int32)
        # llama-bench's pp: BOS then random ids; token identity does not
        # change the work.
        rng = np.random.default_rng(0)
        self.prompt = rng.integers(0, model.n_vocab, N_PROMPT, dtype=np.int32)
        if bos >= 0:
            self.prompt[0] = bos

    def tg_run(self) -> tuple[float, int]:
        """Seconds for generate(128 tokens), and the number of tokens it returned."""
        self.tg.kv_clear()
        self.sampler.reset()
        t0 = pc()
        toks, _ = self.tg.generate(self.gen_prompt, self.sampler, max_tokens=N_GEN, ignore_eos=True)
        t1 = pc()
        return (t1 - t0) / 1e9, len(toks)

    def pp_run(self) -> float:
        """Seconds to decode the 512-token prompt in n_batch chunks (KV cleared first, untimed)."""
        self.pp.kv_clear()
        t0 = pc()
        for off in range(0, N_PROMPT, N_BATCH):
            self.pp.decode(self.prompt[off:off + N_BATCH])
        t1 = pc()
        return (t1 - t0) / 1e9

    def close(self):
        self.tg.close()
        self.pp.close()


def throughput(exe: Path, model_path: Path, runner: LlamaxRunner, threads: int, runs: int,
               extra: tuple[str, ...] = ()) -> dict:
    pairs, warmup = [], None
    for i in range(runs + 1):  # pair 0 is the warm-up, not reported
        b = run_llama_bench(exe, model_path, threads, extra)
        tg_s, n_tok = runner.tg_run()
        pp_s = runner.pp_run()
        if n_tok != N_GEN:
            raise RuntimeError(f"generate returned {n_tok} tokens, expected {N_GEN}")
        lx_tg = N_GEN / tg_s
        lx_pp = N_PROMPT / pp_s
        pair = {
            "bench_tg_ts": b["tg_ts"], "llamax_tg_ts": lx_tg, "tg_ratio": lx_tg / b["tg_ts"],
            # per generated token: llamax's wall time minus llama-bench's
            "overhead_us_per_token": (1e6 / lx_tg) - (1e6 / b["tg_ts"]),
            "bench_pp_ts": b["pp_ts"], "llamax_pp_ts": lx_pp, "pp_ratio": lx_pp / b["pp_ts"],
            "llama_bench_raw": b["raw"],
            "llama_bench_cmd": b["cmd"],
        }
        tag = "warm-up" if i == 0 else f"run {i}/{runs}"
        print(f"  {tag}: tg llama-bench {b['tg_ts']:.1f} llamax {lx_tg:.1f} t/s | "
              f"pp llama-bench {b['pp_ts']:.1f} llamax {lx_pp:.1f} t/s", file=sys.stderr, flush=True)
        if i:
            pairs.append(pair)
        else:
            warmup = pair
    col = lambda k: [p[k] for p in pairs]  # noqa: E731
    return {
        "warmup_pair": warmup,
        "pairs": pairs,
        "tg": {"llama_bench": summary(col("bench_tg_ts")), "llamax": summary(col("llamax_tg_ts")),
               "ratio": summary(col("tg_ratio"))},
        "pp": {"llama_bench": summary(col("bench_pp_ts")), "llamax": summary(col("llamax_pp_ts")),
               "ratio": summary(col("pp_ratio"))},
        "overhead_us_per_token": summary(col("overhead_us_per_token")),
        "bench_cmd": " ".join(warmup["llama_bench_cmd"]),
    }


# ---------------------------------------------------------------------------
# per-call costs

def per_call_us(loop, calls_per_iter: int, budget_s: float, batches: int) -> dict:
    """Time ``loop(k)`` (k iterations of ``calls_per_iter`` calls) in batches.

    k is calibrated so each batch takes about budget_s / batches: enough
    calls that perf_counter resolution and loop overhead vanish, few enough
    that slow calls stay quick.  Returns µs per call for every batch.
    """
    k = 1
    while True:
        t0 = pc()
        loop(k)
        dt = (pc() - t0) / 1e9
        if dt >= budget_s / batches / 8 or k >= 1 << 22:
            break
        k *= 4
    k = max(1, int(k * (budget_s / batches) / max(dt, 1e-9)))
    samples = []
    for _ in range(batches):
        t0 = pc()
        loop(k)
        samples.append((pc() - t0) / 1e3 / (k * calls_per_iter))
    return {"us_per_call": summary(samples), "samples_us": samples, "calls_per_batch": k * calls_per_iter}


def deferred_reserve(ctx: llamax.Context, change, same, token: np.ndarray, n: int) -> dict:
    """Extra cost of the first decode after a state change.

    llama.cpp only flags the compute graph for re-reservation when adapters
    or a control vector change; the work happens in the next decode.  Each
    iteration times a 1-token decode after a no-op re-apply (baseline), then
    one after a real change, alternating so drift cancels.
    """
    base, after = [], []
    for i in range(n):
        same(i)
        ctx.kv_clear()
        t0 = pc()
        ctx.decode(token)
        base.append((pc() - t0) / 1e3)
        change(i)
        ctx.kv_clear()
        t0 = pc()
        ctx.decode(token)
        after.append((pc() - t0) / 1e3)
    extra = [a - b for a, b in zip(after, base)]
    return {"decode_us_after_noop": summary(base), "decode_us_after_change": summary(after),
            "extra_us": summary(extra), "samples_noop_us": base, "samples_change_us": after}


def make_loras(model_path: Path, out_dir: Path, rank: int = 8) -> tuple[list[Path], str]:
    """Two seeded random LoRA adapters for the model (same shapes, different weights)."""
    from llamax import gguf_tools
    paths = [gguf_tools.make_lora(model_path, out_dir / f"lora{s}.gguf", rank=rank, seed=s) for s in (0, 1)]
    return paths, "llamax.gguf_tools.make_lora (default targets)"


def toggle_costs(ctx, apply, states, budget, batches, token, n_deferred):
    """For a state setter (set_adapters / set_control_vector) and two states:
    µs per switch (A ↔ B), µs per identical re-apply, the llama.cpp calls each
    made, and the graph re-reserve the next decode pays after a switch."""
    a, b = states

    def switch(k):
        for _ in range(k):
            apply(a)
            apply(b)

    def reapply(k):
        for _ in range(k):
            apply(b)

    n0 = ctx.n_state_calls
    sw = per_call_us(switch, 2, budget, batches)
    n1 = ctx.n_state_calls
    re = per_call_us(reapply, 1, budget, batches)
    n2 = ctx.n_state_calls
    deferred = deferred_reserve(ctx, change=lambda i: apply(states[(i + 1) & 1]),
                                same=lambda i: apply(states[i & 1]), token=token, n=n_deferred)
    return sw, re, (n1 - n0, n2 - n1), deferred


def state_costs(model: llamax.Model, model_path: Path, threads: int, quick: bool) -> dict:
    budget = 0.2 if quick else 0.5      # seconds per micro-benchmark
    batches = 3 if quick else 7
    n_deferred = 6 if quick else 20     # decode pairs per deferred-cost measurement
    ctx = llamax.Context(model, n_threads=threads, n_threads_batch=threads)  # llamax defaults otherwise
    token = np.array([max(model.token_bos, 0)], dtype=np.int32)
    out = {"context": {"n_ctx": ctx.n_ctx, "n_batch": ctx.n_batch, "n_ubatch": ctx.n_ubatch,
                       "n_threads": threads}}
    with tempfile.TemporaryDirectory(prefix="llamax-bench-") as d:
        paths, how = make_loras(model_path, Path(d))
        adapters = [llamax.LoraAdapter(model, p) for p in paths]
        out["lora"] = {"made_by": how, "rank": 8, "file_bytes": [p.stat().st_size for p in paths]}
        sets = [[(adapters[0], 1.0)], [(adapters[1], 1.0)]]
        (out["adapter_swap"], out["adapter_reapply"], (n_sw, n_re),
         out["adapter_deferred_reserve"]) = toggle_costs(ctx, ctx.set_adapters, sets, budget, batches, token,
                                                         n_deferred)
        # Evidence that a swap reaches llama.cpp every time and a re-apply never does.
        out["adapter_state_calls"] = {"during_swaps": n_sw, "during_reapplies": n_re}
        ctx.set_adapters([])  # back to the base model; the adapters can be freed with the folder

    rng = np.random.default_rng(0)
    n_rows = model.n_layer - 1          # llama.cpp control vectors cover layers 1..n_layer-1
    cvs = [llamax.ControlVector.from_rows(
        model, (rng.standard_normal(n_rows * model.n_embd) * 0.01).astype(np.float32), 1, model.n_layer - 1)
        for _ in range(2)]
    (out["cvec_apply"], out["cvec_reapply"], (n_ap, n_re),
     out["cvec_deferred_reserve"]) = toggle_costs(ctx, ctx.set_control_vector, cvs, budget, batches, token,
                                                  n_deferred)
    out["cvec_state_calls"] = {"during_applies": n_ap, "during_reapplies": n_re}
    ctx.set_control_vector(None)

    # Logits view: a fresh decode, then the view over its single output row.
    ctx.kv_clear()
    ctx.decode(token)
    gl = ctx.get_logits
    shape = gl().shape

    def logits(k):
        for _ in range(k):
            gl()  # the view is dropped at once, releasing its export count

    out["get_logits"] = per_call_us(logits, 1, budget, batches)
    out["get_logits"]["shape"] = list(shape)

    # One greedy sample over the vocabulary: the part of generate's per-token
    # cost that llama-bench's tg loop (which feeds random ids) never pays.
    smp = llamax.Sampler(model, temperature=0.0)

    def sample(k):
        for _ in range(k):
            smp.sample(ctx, -1)

    out["greedy_sample"] = per_call_us(sample, 1, budget, batches)
    ctx.close()
    return out


# ---------------------------------------------------------------------------
# GIL release

def gil_check(model: llamax.Model, threads: int, reps: int) -> dict:
    """Counter-thread rate during generate / its solo rate, `reps` times each, alternating.

    If generate held the GIL, the counter would stall for the whole call
    (fraction near 0).  The counter also needs a free core: with llama.cpp's
    threads on every core the fraction measures CPU contention as much as the
    GIL, so the thread count used is recorded with the result.
    """
    ctx = llamax.Context(model, n_ctx=N_GEN, n_threads=threads, n_threads_batch=threads)
    smp = llamax.Sampler(model, temperature=0.0)
    prompt = np.array([max(model.token_bos, 0)], dtype=np.int32)

    def generate():
        ctx.kv_clear()
        ctx.generate(prompt, smp, max_tokens=N_GEN, ignore_eos=True)

    generate()  # warm-up, and the duration the solo runs copy
    t0 = pc()
    generate()
    gen_s = (pc() - t0) / 1e9

    def counted(during) -> float:
        flag = [True]
        res = {}

        def counter():
            n = 0
            t = time.perf_counter()
            while flag[0]:   # pure Python: needs the GIL for every iteration
                n += 1
            res["rate"] = n / (time.perf_counter() - t)

        th = threading.Thread(target=counter)
        th.start()
        during()
        flag[0] = False
        th.join()
        return res["rate"]

    solo, busy = [], []
    for _ in range(reps):
        solo.append(counted(lambda: time.sleep(gen_s)))  # sleep releases the GIL
        busy.append(counted(generate))
    solo.append(counted(lambda: time.sleep(gen_s)))  # bracket the last busy run
    ctx.close()
    # each busy run against the mean of the solo runs either side of it
    fr = [b / ((solo[i] + solo[i + 1]) / 2) for i, b in enumerate(busy)]
    return {"n_threads": threads, "generate_s": gen_s, "fraction": summary(fr),
            "solo_rate_per_s": solo, "busy_rate_per_s": busy, "fraction_samples": fr}


# ---------------------------------------------------------------------------
# report

def _la(la):
    return "/".join(f"{x:.2f}" for x in la) if la else "n/a"


def table(res: dict) -> str:
    m, tp, st, g = res["machine"], res["throughput"], res["state_costs"], res["gil"]
    n = tp["tg"]["ratio"]["n"]
    lines = [
        f"# llamax engine benchmark ({res['date']}{', --quick smoke run' if res['quick'] else ''})",
        "",
        f"{res['model_name']}, {res['threads']} threads, {m['cpu_model']} ({m['cpus_usable']} usable CPUs), "
        f"Python {m['python']}, numpy {m['numpy']}, llama.cpp {m['llama_cpp_pin']['upstream_commit']} "
        f"(llama-cpp-python {m['llama_cpp_pin']['llama_cpp_python_sdist']} sdist), "
        f"load average {_la(res['loadavg_start'])} → {_la(res['loadavg_end'])}.",
        f"Medians of {n} interleaved pairs after a warm-up pair, (min–max); ratios are medians of per-pair ratios."
        + (" Load average above half the CPUs: other work was running, numbers are noisy."
           if res["loadavg_start"] and max(res["loadavg_start"][0], (res["loadavg_end"] or [0])[0])
           > 0.5 * (m["cpus_usable"] or 1) else ""),
        "",
        "| throughput | llamax | llama-bench | llamax / llama-bench |",
        "|---|---|---|---|",
        f"| decode tg{N_GEN} (tok/s) | {fmt(tp['tg']['llamax'])} | {fmt(tp['tg']['llama_bench'])} "
        f"| {fmt(tp['tg']['ratio'], 3)} |",
        f"| prompt pp{N_PROMPT} (tok/s) | {fmt(tp['pp']['llamax'])} | {fmt(tp['pp']['llama_bench'])} "
        f"| {fmt(tp['pp']['ratio'], 3)} |",
        "",
        "| per-call cost | µs |",
        "|---|---|",
        f"| generate overhead per token (llamax − llama-bench time/token) | {fmt(tp['overhead_us_per_token'])} |",
        f"| … of which one greedy sample over n_vocab={st['get_logits']['shape'][1]} "
        f"(`Sampler.sample`) | {fmt(st['greedy_sample']['us_per_call'], 2)} |",
        f"| `set_adapters` swap (A ↔ B, reaches llama.cpp) | {fmt(st['adapter_swap']['us_per_call'], 2)} |",
        f"| `set_adapters` identical re-apply (no-op) | {fmt(st['adapter_reapply']['us_per_call'], 2)} |",
        f"| deferred graph re-reserve in the next decode after a swap | "
        f"{fmt(st['adapter_deferred_reserve']['extra_us'])} |",
        f"| `set_control_vector` apply (cv1 ↔ cv2) | {fmt(st['cvec_apply']['us_per_call'], 2)} |",
        f"| `set_control_vector` identical re-apply (no-op) | {fmt(st['cvec_reapply']['us_per_call'], 2)} |",
        f"| deferred graph re-reserve in the next decode after a cv apply | "
        f"{fmt(st['cvec_deferred_reserve']['extra_us'])} |",
        f"| `get_logits()` view {tuple(st['get_logits']['shape'])} | {fmt(st['get_logits']['us_per_call'], 2)} |",
        "",
        "| GIL release | counter-thread rate during generate / solo rate |",
        "|---|---|",
    ]
    for gg in g:
        lines.append(f"| generate({N_GEN} tokens) with n_threads={gg['n_threads']} "
                     f"| {fmt(gg['fraction'], 3)} |")
    lines += [
        "",
        f"llama-bench: `{tp['bench_cmd']}` per pair.  State changes: adapter swaps made "
        f"{st['adapter_state_calls']['during_swaps']} llama.cpp calls, re-applies "
        f"{st['adapter_state_calls']['during_reapplies']}; control-vector applies "
        f"{st['cvec_state_calls']['during_applies']}, re-applies {st['cvec_state_calls']['during_reapplies']}.",
        "",
    ]
    return "\n".join(lines)


def write_atomic(path: Path, text: str):
    tmp = path.with_name(path.name + ".tmp")  # *.tmp is git-ignored
    tmp.write_text(text)
    tmp.replace(path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF model (default: the cached SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5, help="measured pairs (after one warm-up pair)")
    ap.add_argument("--quick", action="store_true", help="smoke check: 2 pairs, short micro-benchmarks")
    ap.add_argument("--gil-threads", type=int,
                    help="n_threads of the generate in the GIL check (default: leave one core free)")
    ap.add_argument("--llama-bench", help="llama-bench binary (default: the cached pinned build)")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    args = ap.parse_args(argv)
    runs = 2 if args.quick else args.runs
    if runs < 1:
        ap.error("--runs must be >= 1")

    model_path = Path(args.model) if args.model else Path(data.smollm2())
    exe = find_llama_bench(args.llama_bench)
    res = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
           "quick": args.quick, "threads": args.threads, "runs": runs,
           "model": str(model_path), "model_name": model_path.name,
           "loadavg_start": loadavg(), "machine": machine_info(exe)}
    if res["loadavg_start"] and res["loadavg_start"][0] > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {res['loadavg_start'][0]:.2f} on {os.cpu_count()} CPUs: "
              "numbers will be noisy", file=sys.stderr)

    model = llamax.Model(model_path)
    res["model_info"] = {"n_vocab": model.n_vocab, "n_embd": model.n_embd, "n_layer": model.n_layer,
                         "description": model.description}
    runner = LlamaxRunner(model, args.threads)
    t_start = time.monotonic()

    def phase(name):
        print(f"[{time.monotonic() - t_start:6.1f}s] {name}", file=sys.stderr, flush=True)

    phase(f"throughput: {runs} pairs + warm-up, llama-bench {exe}")
    res["throughput"] = throughput(exe, model_path, runner, args.threads, runs)
    runner.close()

    phase("state-change and view costs")
    res["state_costs"] = state_costs(model, model_path, args.threads, args.quick)

    phase("GIL check")
    gil_reps = 2 if args.quick else 5
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # llama.cpp's workers spin at barriers; with them on every core, a third
    # busy thread gets them preempted mid-graph and generate slows down by
    # orders of magnitude, which measures the scheduler, not the GIL.  So a
    # core is left free for the counter (1 thread on a 2-core machine).
    gil_threads = args.gil_threads or max(1, min(args.threads, cores - 1))
    res["gil"] = [gil_check(model, gil_threads, gil_reps)]
    res["loadavg_end"] = loadavg()
    res["elapsed_s"] = time.monotonic() - t_start
    phase("done")
    model.close()

    md = table(res)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "engine.json", json.dumps(res, indent=1, default=str) + "\n")
    write_atomic(out / "engine.md", md)
    print(f"wrote {out / 'engine.json'} and {out / 'engine.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
