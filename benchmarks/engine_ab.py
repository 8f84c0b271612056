"""The engine alone, in process, under the serving benchmark's kind of load:
which request shapes and LoRA-table settings cost what.

  python3 benchmarks/engine_ab.py [--clients 8] [--rounds 5]
        [--shapes completion,long,chat,stream,chatstream] [--tables r16,r8,none]

One ``Llama(n_parallel=16)`` per table setting (``r16``: the default
``max_lora_rank=16``; ``r8``: ``max_lora_rank=8``; ``none``:
``max_lora_slots=0``, the union path), each with bench_server.py's adapter
"coder" registered; every request uses it.  A round runs ``clients``
concurrent requests of 48 tokens (end tokens banned) for every (table,
shape) pair, the order reversed every other round; printed: the median
generated tok/s of each pair and its ratio to the first pair.  Shapes:

- completion: a 12-token prompt, the answer whole;
- long: a 40-token prompt of the same length as the chat one;
- chat: SmolLM2's chat template around the 12-token request (40 tokens);
- stream / chatstream: completion / chat, streamed chunk by chunk.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import llamax
from llamax import gguf_tools
from llamax.models import cache_dir, default_model

TABLES = {"r16": dict(max_lora_slots=16, max_lora_rank=16), "r8": dict(max_lora_slots=16, max_lora_rank=8),
          "none": dict(max_lora_slots=0)}
REQUEST = "Tell me about the history of tea."
SYSTEM = "System: You are a helpful AI assistant named SmolLM, trained by Hugging Face, and you answer well. "


async def run(llm, shape: str, clients: int, tokens: int, ban: dict) -> float:
    async def one(i):
        kw = dict(max_tokens=tokens, temperature=0.7, seed=i, logit_bias=ban,
                  active_loras=[{"name": "coder", "scale": 1.0}])
        messages = [{"role": "user", "content": f"Request {i}. {REQUEST}"}]
        if shape == "completion":
            await llm.acreate_completion(f"Request {i}. {REQUEST}", **kw)
        elif shape == "long":
            await llm.acreate_completion(f"{SYSTEM}User: Request {i}. {REQUEST} Assistant:", **kw)
        elif shape == "chat":
            await llm.acreate_chat_completion(messages=messages, **kw)
        else:
            it = await (llm.acreate_completion(f"Request {i}. {REQUEST}", stream=True, **kw) if shape == "stream"
                        else llm.acreate_chat_completion(messages=messages, stream=True, **kw))
            async for _ in it:
                pass

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(clients)))
    return clients * tokens / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--shapes", default="completion,long,chat,stream,chatstream")
    p.add_argument("--tables", default="r16,r8,none")
    a = p.parse_args(argv)
    model = default_model(progress=True)
    d = cache_dir() / "bench"
    d.mkdir(parents=True, exist_ok=True)
    coder = gguf_tools.make_lora(model, d / "srv-coder.gguf", rank=8, seed=1, std=0.05)
    llms = {}
    for t in a.tables.split(","):
        llm = llamax.Llama(str(model), n_parallel=16, n_ctx=16 * 1024, n_threads=a.threads, **TABLES[t])
        llm.register_lora("coder", str(coder), load=True)
        llms[t] = llm
    m = next(iter(llms.values()))._native_model
    ban = {t: -100.0 for t in range(m.n_vocab) if m.is_eog(t)}
    pairs = [(t, s) for t in llms for s in a.shapes.split(",")]
    for t, s in pairs:  # warm-up
        asyncio.run(run(llms[t], s, 2, 4, ban))
    got = {k: [] for k in pairs}
    for r in range(a.rounds):
        for t, s in (pairs if r % 2 == 0 else pairs[::-1]):
            got[(t, s)].append(asyncio.run(run(llms[t], s, a.clients, a.tokens, ban)))
    first = statistics.median(got[pairs[0]])
    print(f"{a.clients} concurrent requests of {a.tokens} tokens, medians of {a.rounds} alternating rounds")
    for (t, s), v in got.items():
        med = statistics.median(v)
        print(f"table {t:4s} {s:10s} {med:7.1f} tok/s  {med / first:.2f}x  runs {[round(x, 1) for x in v]}")
    for llm in llms.values():
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
