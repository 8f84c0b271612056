"""Tool calls (issue #35 item 7): how often a reply's calls are invalid,
with and without adapters, and what constrained decoding costs per token.

  python3 benchmarks/bench_tools.py [--prompts 50] [--threads 2] [--rounds 3]

Model: SmolLM2-135M-Instruct Q4_1, greedy, on two chat templates: its own
ChatML (declares no tools: the generic JSON answer, described in a system
prompt) and a Hermes-style template given as ``chat_template=``
(``<tool_call>`` blocks; llamax_dev.chat_templates.HERMES).  Three tools
(weather, time, add; JSON Schemas with enums, bounds and required keys).

- validity: --prompts user requests x adapter sets {base, json, shout (the
  two adapters llamax ships), json+shout} x tool_choice {required, a named
  function, auto}.  A reply counts as *invalid* when it should hold calls
  and holds none, or any call's arguments fail ``jsonschema`` against its
  tool's schema; *cut* counts replies that max_tokens (96) ended first
  (reported apart: they are neither valid calls nor the model's choice).
  For auto, "calls" is the share of replies that called a tool.
- cost: per token, generation under the required-call grammar against the
  same prompts and the same number of tokens without a grammar (end of
  text banned), cold each time; rounds alternate the two, medians shown.

Writes results/tools.md and results/tools.json (raw; not committed).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema

import llamax
from llamax_dev import data
from llamax_dev.chat_templates import HERMES

import bench_engine  # machine info (benchmarks/, this script's folder)

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 96

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {
            "zone": {"type": "string", "maxLength": 40}, "hours24": {"type": "boolean"}},
            "required": ["zone", "hours24"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quebec", "Seoul", "Nairobi", "Dublin"]
ASKS = ["What's the weather in {c}?", "What time is it in {c}?", "What is {a} plus {b}?",
        "Is it cold in {c} today?", "Tell me the local time in {c}, 24-hour clock.", "Add {a} and {b} for me.",
        "Write two sentences about {c}.", "Hello! What can you do?", "How warm is {c} in fahrenheit?",
        "Sum of {a} and {b}?"]
ADAPTERS = {"base": None, "json": [{"name": "json", "scale": 1.0}], "shout": [{"name": "shout", "scale": 1.0}],
            "json+shout": [{"name": "json", "scale": 0.5}, {"name": "shout", "scale": 0.5}]}


def prompts(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(c=CITIES[(i * 7) % len(CITIES)], a=3 + i * 11, b=40 - i * 3)
            for i in range(n)]


def judge(reply: dict, expect_calls: bool) -> str:
    """'valid', 'invalid', 'words' (auto: no call) or 'cut'."""
    choice = reply["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    if choice["finish_reason"] == "length" and not calls:
        return "cut"
    if not calls:
        return "invalid" if expect_calls else "words"
    for c in calls:
        name = c["function"]["name"]
        try:
            jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[name])
        except (KeyError, ValueError, jsonschema.ValidationError):
            return "invalid"
    return "valid"


def validity(llm, ps: list[str]) -> dict:
    out: dict = {}
    for aname, loras in ADAPTERS.items():
        for mode in ("required", "named", "auto"):
            tally = {"valid": 0, "invalid": 0, "words": 0, "cut": 0}
            for i, p in enumerate(ps):
                choice = mode if mode != "named" else {"type": "function",
                                                       "function": {"name": TOOLS[i % 3]["function"]["name"]}}
                llm.reset_cache()
                r = llm.create_chat_completion([{"role": "user", "content": p}], tools=TOOLS, tool_choice=choice,
                                               max_tokens=MAX_TOKENS, temperature=0, active_loras=loras)
                tally[judge(r, mode != "auto")] += 1
            out[f"{aname}/{mode}"] = tally
            print(f"  {aname:10s} {mode:8s} {tally}", flush=True)
    return out


def cost(llm, ps: list[str], rounds: int) -> dict:
    """ms per generated token with the required-call grammar and without."""
    from llamax.tool_calls.plan import chat_plan

    eos = llm.token_eos()
    times: dict = {"grammar": [], "free": []}
    for _ in range(rounds):
        per = {"grammar": [0.0, 0], "free": [0.0, 0]}
        for p in ps:
            msgs = [{"role": "user", "content": p}]
            plan = chat_plan(TOOLS, "required", False, llm._template.source, None)  # the grammar a request runs
            text = llm.apply_chat_template(plan.messages(msgs), tools=TOOLS)
            toks = llm.tokenize(text.encode(), add_bos=False, special=True)
            llm.reset_cache()
            t0 = time.perf_counter()
            r = llm.create_completion(toks, grammar=plan.grammar, max_tokens=MAX_TOKENS, temperature=0)
            t_g = time.perf_counter() - t0
            n = r["usage"]["completion_tokens"]
            llm.reset_cache()
            t0 = time.perf_counter()
            r2 = llm.create_completion(toks, max_tokens=n, temperature=0, logit_bias={eos: float("-inf")})
            t_f = time.perf_counter() - t0
            # the prompt is decoded in both: time it alone, cold, and take it off
            llm.reset_cache()
            t0 = time.perf_counter()
            llm.create_completion(toks, max_tokens=1, temperature=0)
            t_p = time.perf_counter() - t0
            assert r2["usage"]["completion_tokens"] == n
            per["grammar"][0] += t_g - t_p
            per["free"][0] += t_f - t_p
            per["grammar"][1] += n - 1
            per["free"][1] += n - 1
        for k in per:
            times[k].append(1000 * per[k][0] / max(1, per[k][1]))
    return {k: statistics.median(v) for k, v in times.items()} | {"rounds": times}


def table(res: dict) -> str:
    lines = ["| template | adapters | tool_choice | replies | invalid | invalid rate | calls (auto) | cut |",
             "|---|---|---|---|---|---|---|---|"]
    for tname, t in res["validity"].items():
        for key, tally in t.items():
            aname, mode = key.split("/")
            n = sum(tally.values())
            calls = f"{tally['valid'] + tally['invalid']}/{n}" if mode == "auto" else "-"
            lines.append(f"| {tname} | {aname} | {mode} | {n} | {tally['invalid']} | "
                         f"{tally['invalid'] / n:.1%} | {calls} | {tally['cut']} |")
    lines += ["", "| template | ms/token, required-call grammar | ms/token, no grammar | ratio |", "|---|---|---|---|"]
    for tname, c in res["cost"].items():
        lines.append(f"| {tname} | {c['grammar']:.2f} | {c['free']:.2f} | {c['grammar'] / c['free']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--cost-only", action="store_true",
                    help="measure the cost again, keep the validity counts of the last run's tools.json")
    a = ap.parse_args(argv)
    ps = prompts(a.prompts)
    res: dict = {"machine": {"cpu": bench_engine.cpu_model(), "flags": bench_engine.cpu_flags()},
                 "prompts": a.prompts, "validity": {}, "cost": {}}
    if a.cost_only:
        res["validity"] = json.loads((Path(a.out) / "tools.json").read_text())["validity"]
    adapters = Path(llamax.__file__).resolve().parent / "data" / "adapters"
    for tname, tmpl in (("SmolLM2 (generic)", None), ("Hermes-style", HERMES)):
        print(tname, flush=True)
        kw = {} if tmpl is None else {"chat_template": tmpl}
        with llamax.Llama(str(data.smollm2()), n_ctx=2048, n_threads=a.threads, verbose=False, **kw) as llm:
            for name in ("json", "shout"):
                llm.load_lora(name, str(adapters / f"{name}.gguf"))
            if not a.cost_only:
                res["validity"][tname] = validity(llm, ps)
            res["cost"][tname] = cost(llm, ps[:10], a.rounds)
            print(f"  cost {res['cost'][tname]['grammar']:.2f} vs {res['cost'][tname]['free']:.2f} ms/token",
                  flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tools.json").write_text(json.dumps(res, indent=1))
    md = f"`python3 benchmarks/bench_tools.py --prompts {a.prompts} --threads {a.threads} --rounds {a.rounds}`\n\n" \
         + table(res) + "\n"
    (out / "tools.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
