"""Runs inside the llama-cpp-python venv (tools/llamax_dev/peers.py) and measures it.

Two modes:
  python peer_worker.py serve           JSON requests on stdin, one per line, JSON
                                        answers on stdout (so the orchestrator can
                                        interleave contestants without reloads)
  python peer_worker.py rss SPEC_JSON   one-shot: load K instances, print peak RSS

Only the standard library, llama_cpp and counter.py (beside this file) are used here.
"""
import json
import resource
import sys
import time

import llama_cpp
from counter import Counter  # benchmarks/counter.py (this script's folder)
from llama_cpp import Llama

_models = {}


def _llm(model, threads, n_ctx, lora=None, scale=1.0):
    key = (model, threads, n_ctx, lora, scale)
    if key not in _models:
        _models[key] = Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                             n_batch=512, n_ubatch=512, verbose=False, lora_path=lora, lora_scale=scale)
    return _models[key]


def tg(req):
    """Seconds for 128 greedy tokens via Llama.generate after BOS (like llama-bench tg128)."""
    llm = _llm(req["model"], req["threads"], 256)
    bos = llm.token_bos()
    llm.reset()
    t0 = time.perf_counter()
    n = 0
    for _tok in llm.generate([bos], top_k=1, temp=0.0, reset=True):
        n += 1
        if n == req["n_gen"]:
            break
    return {"seconds": time.perf_counter() - t0, "n": n}


def completion(req):
    """Seconds for create_completion(max_tokens=n_gen) (the high-level path)."""
    llm = _llm(req["model"], req["threads"], 256)
    llm.reset()
    t0 = time.perf_counter()
    r = llm.create_completion(req["prompt"], max_tokens=req["n_gen"], temperature=0.0, top_k=1)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "n": r["usage"]["completion_tokens"]}


def pp(req):
    """Seconds to evaluate a prompt of n_prompt tokens."""
    llm = _llm(req["model"], req["threads"], 1024)
    toks = [llm.token_bos()] + [(i * 7919) % 1000 + 100 for i in range(req["n_prompt"] - 1)]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(toks)
    return {"seconds": time.perf_counter() - t0, "n": len(toks)}


def tenants(req):
    """Round-robin requests over adapter sets.  mode 'reload': one Llama,
    re-created with lora_path whenever the adapter changes (llama-cpp-python's
    only way to switch); mode 'instances': one Llama per adapter."""
    lat = []
    cur = None
    llm = None
    insts = {}
    t_all = time.perf_counter()
    for tenant, prompt in req["requests"]:
        lora = req["loras"][tenant]
        t0 = time.perf_counter()
        if req["mode"] == "reload":
            if cur != (lora,) or llm is None:
                if llm is not None:
                    llm.close()
                llm = Llama(model_path=req["model"], n_ctx=req["n_ctx"], n_threads=req["threads"],
                            n_threads_batch=req["threads"], verbose=False, lora_path=lora)
                cur = (lora,)
            m = llm
        else:
            if tenant not in insts:
                insts[tenant] = Llama(model_path=req["model"], n_ctx=req["n_ctx"], n_threads=req["threads"],
                                      n_threads_batch=req["threads"], verbose=False, lora_path=lora)
            m = insts[tenant]
        m.create_completion(prompt, max_tokens=req["max_tokens"], temperature=0.0, top_k=1)
        lat.append(time.perf_counter() - t0)
    total = time.perf_counter() - t_all
    for m in insts.values():
        m.close()
    if llm is not None:
        llm.close()
    return {"latencies": lat, "total": total}


def concurrent(req):
    """N threads, each one create_completion of max_tokens (EOS banned), on
    one Llama behind one lock: how a llama-cpp-python service serves
    concurrent requests (its server serializes them the same way).  Returns
    the total seconds and, per request, its token timestamps."""
    import threading
    llm = _llm(req["model"], req["threads"], req["n_ctx"])
    lock = threading.Lock()
    eos = llm.token_eos()
    stamps = [None] * len(req["prompts"])
    t_all = time.perf_counter()

    def run(i):
        ts = []
        with lock:
            llm.reset()
            for _ in llm.create_completion(req["prompts"][i], max_tokens=req["max_tokens"], temperature=0.0,
                                           top_k=1, logit_bias={eos: -1e9}, stream=True):
                ts.append(time.perf_counter() - t_all)
        stamps[i] = ts

    ths = [threading.Thread(target=run, args=(i,)) for i in range(len(req["prompts"]))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return {"total": time.perf_counter() - t_all, "stamps": stamps}


def gil(req):
    """A pure-Python counter thread's count during a 128-token generate."""
    llm = _llm(req["model"], req["threads"], 256)
    bos = llm.token_bos()
    with Counter() as c:
        k = 0
        for _tok in llm.generate([bos], top_k=1, temp=0.0, reset=True):
            k += 1
            if k == 128:
                break
    return {"count": c.count, "seconds": c.seconds}


def ttft(req):
    """Seconds to the first streamed chunk for a prompt (the instance's own
    prefix reuse applies when the same prompt comes again)."""
    llm = _llm(req["model"], req["threads"], 2048)
    if req.get("cold"):
        llm.reset()
    t0 = time.perf_counter()
    dt = None
    for _ in llm.create_completion(req["prompt"], max_tokens=4, temperature=0.0, top_k=1, stream=True):
        dt = time.perf_counter() - t0  # at the first chunk, before the stream is closed
        break
    return {"seconds": dt}


_embedders = {}


def embed(req):
    """Seconds for Llama.embed over the sentences, in calls of batch_size
    (default: one call); the vectors too when asked (for the parity column)."""
    key = (req["model"], req["threads"])
    if key not in _embedders:
        _embedders[key] = Llama(model_path=req["model"], embedding=True, n_ctx=512, n_batch=512, n_ubatch=512,
                                n_threads=req["threads"], n_threads_batch=req["threads"], verbose=False)
    llm = _embedders[key]
    texts = req["sentences"]
    bs = req.get("batch_size") or len(texts)
    t0 = time.perf_counter()
    vecs = []
    for i in range(0, len(texts), bs):
        vecs += llm.embed(texts[i:i + bs], normalize=True)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "vectors": vecs if req.get("return_vectors") else None}


def serve():
    ops = {"tg": tg, "pp": pp, "completion": completion, "tenants": tenants, "gil": gil, "concurrent": concurrent, "ttft": ttft,
           "embed": embed}
    from llamax_dev.worker_loop import serve as loop
    loop({"version": llama_cpp.__version__}, ops)


def rss(spec):
    insts = [Llama(model_path=spec["model"], n_ctx=spec["n_ctx"], n_threads=1, verbose=False,
                   lora_path=spec.get("lora")) for _ in range(spec["k"])]
    peak = None
    for line in open("/proc/self/status"):  # VmHWM: ru_maxrss survives exec on Linux
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) * 1024
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_rss": peak, "k": len(insts)}))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve()
    else:
        rss(json.loads(sys.argv[2]))
