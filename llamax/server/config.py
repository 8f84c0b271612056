"""The server's options: :class:`ServerConfig` (every server), :class:`RayOptions`
(``--replicas``), and the command line that fills them.

Standard library only: ``python -m llamax --help`` works without the
``server`` extra."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

__all__ = ["ServerConfig", "RayOptions", "add_arguments", "server_config", "ray_options"]


@dataclasses.dataclass
class ServerConfig:
    """Every option of ``python -m llamax serve`` (checked on creation: ValueError)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    alias: str | None = None
    n_contexts: int = 1
    parallel: int = 4
    n_ctx: int = 4096
    n_batch: int = 512
    threads: int | None = None
    n_gpu_layers: int | None = None  # None: LLAMAX_N_GPU_LAYERS, else 0
    loras: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    lora_dir: str | None = None
    max_loaded_adapters: int | None = None
    prefix_cache: str = "any"   # any | exact | off (see Llama's prefix_cache_exact)
    control_vectors: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    api_keys: list[str] = dataclasses.field(default_factory=list)
    admin_api_keys: list[str] = dataclasses.field(default_factory=list)
    allow_runtime_lora: bool = False
    max_queue: int = 64
    metrics: bool = False
    max_body_bytes: int = 8 << 20
    request_timeout: float = 600.0
    shutdown_timeout: float = 10.0
    chat_format: str | None = None
    chat_template: str | None = None
    verbose: bool = False
    # adapters in the default set (what requests naming none get): name -> scale (--lora-scaled)
    lora_scales: dict[str, float] = dataclasses.field(default_factory=dict)
    # llama.cpp's model and context keywords, passed to llamax.Llama as they are
    # (type_k/type_v, flash_attn, rope_*, yarn_*, kv_overrides), checked there
    llama_options: dict = dataclasses.field(default_factory=dict)
    # tenants (docs/tenants.md): the file, the usage log, and the slots a
    # tenant over its share leaves free (None: 1 with a tenants file, else 0)
    tenants: str | None = None
    usage_log: str | None = None
    reserve_slots: int | None = None
    # the thinking budget of chat requests that set none (-1: none), and the
    # text put before the closing tag when it runs out
    reasoning_budget: int = -1
    reasoning_budget_message: str | None = None
    # every generation on the reference kernels: the same answer whoever
    # else is in the batch, whatever the cache reused (docs/determinism.md)
    deterministic: bool = False
    # serve embeddings only (llama-server's --embedding): implied by an
    # encoder model (BERT family: non-causal attention); pooling: the
    # embedding pooling (None: the model's own, else mean)
    embedding: bool = False
    pooling: str | None = None
    # llama-server's server-wide defaults: sampling fields a request leaves
    # unset (--temp, --top-k, ...: SamplingParams names), and its n_predict
    # (max tokens of a request that sets none; -1: none)
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
    n_predict: int = -1
    slots: bool = True                 # GET /slots (llama-server's --no-slots: 501)
    cors_origins: str | None = None    # "*", "localhost" or origins, comma-separated (None: no CORS)
    # llama-server's --reasoning: the templates' enable_thinking (None: the template's default)
    enable_thinking: bool | None = None
    # llama-server's --sleep-idle-seconds: the model is let go after this long
    # without a request, and loaded again by the next one (None: never)
    sleep_idle_seconds: float | None = None
    # a model name the server does not know gets the base model, as on
    # llama-server (for clients that send a fixed name); default: a 404
    any_model: bool = False
    # more names of the base model (llama-server's --alias A,B,C: the first is
    # its id), and llama-server's --tags (labels on its /v1/models card)
    aliases: list[str] = dataclasses.field(default_factory=list)
    tags: list[str] = dataclasses.field(default_factory=list)
    # an adapter store (docs/adapter-store.md): a directory, s3://bucket/prefix
    # or hf://org; requests name its adapters, fetched on first use into a
    # disk cache (adapter_cache_dir, at most adapter_cache_bytes), checked
    # again after adapter_store_ttl seconds (a newer version then replaces it)
    adapter_store: str | None = None
    adapter_cache_dir: str | None = None
    adapter_cache_bytes: int = 10 << 30
    adapter_store_ttl: float = 60.0
    adapter_max_bytes: int = 1 << 30     # a bigger adapter is refused before it is fetched
    adapter_max_rank: int | None = None  # a larger rank is refused (None: any)
    adapter_store_timeout: float = 30.0  # a lookup and fetch slower than this is a 503
    adapter_fetch_workers: int = 4       # fetches and loads at once (other requests never wait for them)

    def __post_init__(self):
        if self.alias is not None and "," in self.alias:
            names = [a.strip() for a in self.alias.split(",") if a.strip()]
            if not names:
                raise ValueError("--alias names no name")
            self.alias, self.aliases = names[0], names[1:] + [a for a in self.aliases if a not in names]
        if self.alias is None:
            self.alias = Path(self.model).stem
        unknown = set(self.lora_scales) - {n for n, _ in self.loras}
        if unknown:
            raise ValueError(f"default scales for adapters that are not loaded: {sorted(unknown)}")
        if self.allow_runtime_lora and not self.admin_api_keys:
            raise ValueError("--allow-runtime-lora needs --admin-api-key: loading files at runtime is an "
                             "admin action, never open to anyone who can reach the port")
        if self.allow_runtime_lora and not self.lora_dir:
            raise ValueError("--allow-runtime-lora needs --lora-dir: the only folder runtime loads may read")
        if self.prefix_cache not in ("any", "exact", "off"):
            raise ValueError(f"--prefix-cache must be any, exact or off, not {self.prefix_cache!r}")
        if self.lora_dir is not None and not os.path.isdir(self.lora_dir):
            raise ValueError(f"--lora-dir {self.lora_dir}: not a directory")
        names = [n for n, _ in self.loras]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"--lora names appear twice: {sorted(dup)}")
        if self.alias in names or set(self.aliases) & set(names):
            raise ValueError(f"an adapter may not be named like the model's aliases "
                             f"{sorted(set(self.aliases) & set(names)) or [self.alias]}")
        if self.tenants is not None and self.api_keys:
            raise ValueError("--api-key with --tenants: give every key a tenant in the tenants file "
                             "(admin keys stay --admin-api-key)")
        if self.reserve_slots is None:
            self.reserve_slots = 1 if self.tenants is not None and self.parallel > 1 else 0
        if not 0 <= self.reserve_slots < max(1, self.parallel):
            raise ValueError(f"--reserve-slots must be in [0, --parallel - 1], not {self.reserve_slots}")
        if isinstance(self.reasoning_budget, bool) or not isinstance(self.reasoning_budget, int) \
                or self.reasoning_budget < -1:
            raise ValueError(f"--reasoning-budget must be -1 (none) or a number of tokens >= 0, "
                             f"not {self.reasoning_budget!r}")
        if self.reasoning_budget_message is not None and self.reasoning_budget < 0:
            raise ValueError("--reasoning-budget-message needs --reasoning-budget N (N >= 0)")
        if self.pooling not in (None, "none", "mean", "cls", "last", "rank"):
            raise ValueError(f"--pooling must be none, mean, cls, last or rank, not {self.pooling!r}")
        if self.pooling == "rank":
            raise ValueError("--pooling rank (a reranker's scores, llama-server's /rerank) is not served by llamax "
                             "yet: serve the model with mean, cls or last pooling, or none (a vector per token)")
        if isinstance(self.n_predict, bool) or not isinstance(self.n_predict, int) or self.n_predict < -1 \
                or self.n_predict == 0:
            raise ValueError(f"--n-predict must be -1 (no limit) or a number of tokens >= 1, not {self.n_predict!r}")
        if self.sleep_idle_seconds is not None:
            if not self.sleep_idle_seconds > 0:
                raise ValueError("--sleep-idle-seconds must be > 0 (-1: never sleep)")
            if self.allow_runtime_lora:
                raise ValueError("--sleep-idle-seconds with --allow-runtime-lora: waking would have to read "
                                 "runtime-loaded adapter files again; give adapters with --lora instead")
        if self.adapter_store is not None:
            if self.adapter_cache_bytes < 1 or self.adapter_max_bytes < 1 or self.adapter_store_ttl < 0 \
                    or not self.adapter_store_timeout > 0 or self.adapter_fetch_workers < 1 \
                    or (self.adapter_max_rank is not None and self.adapter_max_rank < 1):
                raise ValueError("--adapter-cache-bytes, --adapter-max-bytes, --adapter-store-timeout, "
                                 "--adapter-fetch-workers and --adapter-max-rank must be positive, "
                                 "--adapter-store-ttl >= 0")
            if self.sleep_idle_seconds is not None:
                raise ValueError("--sleep-idle-seconds with --adapter-store is not supported yet")
            if self.max_loaded_adapters is None:
                self.max_loaded_adapters = 64  # a store may hold thousands: memory is a bounded tier too
            from llamax.adapter_store import open_store
            open_store(self.adapter_store)  # a bad URI or a missing client library stops the server now
        elif self.adapter_cache_dir is not None:
            raise ValueError("--adapter-cache-dir needs --adapter-store")
        if self.tenants is not None:
            from llamax.server.tenants import load_tenants
            load_tenants(self.tenants)  # a bad file stops the server before it starts
        if self.usage_log is not None:
            try:
                with open(self.usage_log, "ab"):
                    pass
            except OSError as e:
                raise ValueError(f"--usage-log {self.usage_log}: {e.strerror or e}") from None


@dataclasses.dataclass
class RayOptions:
    """How ``--replicas`` serves: Ray Serve replicas, adapter sets and affinity."""

    replicas: int = 2
    max_sets: int = 4                  # adapter sets Ray's router keeps per replica (--max-adapter-sets)
    max_adapters: int = 8              # adapters loaded per replica, and per request (--max-loaded-adapters)
    max_affinity_sets: int = 1024      # distinct sets sent as multiplexed ids (later ones: no affinity)
    replica_cpus: float = 1.0          # Ray's logical CPUs per replica
    max_ongoing_requests: int | None = None
    affinity: bool = True              # False: Ray's default routing (benchmarks compare)


def _named(value: str) -> tuple[str, str]:
    """NAME=PATH, or a bare PATH named by its file's stem (llama-server's --lora)."""
    if "=" in value:
        name, path = value.split("=", 1)
        if not name:
            raise argparse.ArgumentTypeError(f"{value!r}: the name before '=' is empty")
    else:
        name, path = Path(value).stem, value
    if not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{path}: no such file")
    return name, path


def _override(value: str) -> tuple[str, object]:
    """llama-server's --override-kv KEY=TYPE:VALUE."""
    key, eq, rest = value.partition("=")
    kind, colon, raw = rest.partition(":")
    if not key or not eq or not colon:
        raise argparse.ArgumentTypeError(f"{value!r}: expected KEY=TYPE:VALUE (TYPE: int, float, bool, str)")
    try:
        if kind == "int":
            return key, int(raw)
        if kind == "float":
            return key, float(raw)
        if kind == "bool" and raw in ("true", "false"):
            return key, raw == "true"
        if kind == "str":
            return key, raw
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{value!r}: {raw!r} is not a {kind} (TYPE: int, float, bool true/false, str)")


def _scaled(pairs) -> tuple[list[tuple[str, str]], dict[str, float]]:
    loras, scales = [], {}
    for spec, scale in pairs:
        name, path = _named(spec)
        try:
            scales[name] = float(scale)
        except ValueError:
            raise ValueError(f"--lora-scaled {spec} {scale}: the scale is not a number") from None
        loras.append((name, path))
    return loras, scales


def llama_options(args) -> dict:
    """The llama.cpp keywords the llama-server flags ask for (only those given)."""
    out: dict = {}
    if args.cache_type_k:
        out["type_k"] = args.cache_type_k
    if args.cache_type_v:
        out["type_v"] = args.cache_type_v
    if args.flash_attn != "auto":
        out["flash_attn"] = args.flash_attn == "on"
    if args.rope_scaling:
        out["rope_scaling_type"] = args.rope_scaling
    if args.rope_scale is not None:
        if not args.rope_scale > 0:
            raise ValueError("--rope-scale must be > 0")
        out["rope_freq_scale"] = 1.0 / args.rope_scale
    for flag in ("rope_freq_base", "rope_freq_scale", "yarn_orig_ctx", "yarn_ext_factor", "yarn_attn_factor",
                 "yarn_beta_slow", "yarn_beta_fast"):
        if getattr(args, flag) is not None:
            out[flag] = getattr(args, flag)
    if args.override_kv:
        out["kv_overrides"] = dict(args.override_kv)
    if args.max_lora_slots is not None:
        if args.max_lora_slots < 0:
            raise ValueError("--max-lora-slots must be >= 0 (0: no LoRA table)")
        out["max_lora_slots"] = args.max_lora_slots
    if args.max_lora_rank is not None:
        if args.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be >= 1")
        out["max_lora_rank"] = args.max_lora_rank
    if args.ubatch_size is not None:
        out["n_ubatch"] = args.ubatch_size
    if args.seed is not None and args.seed != -1:
        out["seed"] = args.seed
    return out


# llama.cpp's built-in template names (llama-server's --chat-template NAME) -> llamax's chat formats
TEMPLATE_NAMES = {"chatml": "chatml", "llama2": "llama-2", "llama3": "llama-3", "zephyr": "zephyr",
                  "gemma": "gemma", "openchat": "openchat", "vicuna": "vicuna", "mistral-v1": "mistral-instruct",
                  "chatglm3": "chatglm3", "qwen": "qwen"}


def _chat_template(args) -> tuple[str | None, str | None]:
    """(template text, chat format) of --chat-template (a file, a built-in
    name, or the text itself) and --chat-template-file."""
    if args.chat_template and args.chat_template_file:
        raise ValueError("give --chat-template or --chat-template-file, not both")
    path = args.chat_template_file
    given = args.chat_template
    if given is not None and path is None:
        if os.path.isfile(given):
            path = given
        elif given in TEMPLATE_NAMES:
            return None, TEMPLATE_NAMES[given]
        elif "{{" in given or "{%" in given:
            return given, None
        else:
            raise ValueError(f"--chat-template {given!r}: not a file, not a template's text, and not a built-in "
                             f"name llamax has ({', '.join(sorted(TEMPLATE_NAMES))})")
    if path is None:
        return None, None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(), None
    except OSError as e:
        raise ValueError(f"--chat-template-file {path}: {e.strerror or e}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="the GGUF model to serve (or -m/--model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port)")
    p.add_argument("--alias", help="the model's name in the API (default: the file's stem)")
    p.add_argument("--n-contexts", type=int, default=1, help="contexts (each with its own batcher; default 1)")
    p.add_argument("--parallel", "-np", type=int, default=4,
                   help="sequences per context, decoded together (default 4)")
    p.add_argument("--n-ctx", "-c", type=int, default=4096, help="context tokens per request (default 4096)")
    p.add_argument("--n-batch", type=int, default=512, help="tokens per decode (default 512)")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: llama.cpp's choice)")
    p.add_argument("--n-gpu-layers", "-ngl", type=int, default=None,
                   help="layers on the GPU, -1 for all (default: LLAMAX_N_GPU_LAYERS, else 0; a build or "
                        "machine without a GPU runs them on the CPU)")
    p.add_argument("--lora", action="append", type=_named, default=[], metavar="[NAME=]PATH",
                   help="an adapter, loaded at start (repeatable; a bare PATH is named by its stem)")
    p.add_argument("--lora-dir", help="the only folder runtime loads may read adapters from")
    p.add_argument("--max-loaded-adapters", type=int, default=None,
                   help="adapters in memory at once, and so per request; others load on demand, least "
                        "recently used unloaded (default: all loaded at start; with --replicas: 8 per replica)")
    p.add_argument("--adapter-store", metavar="URI",
                   help="where adapters are kept by name: a directory, s3://bucket/prefix (boto3: the standard "
                        "AWS configuration) or hf://org (huggingface_hub); requests name them and they are "
                        "fetched on first use (docs/adapter-store.md)")
    p.add_argument("--adapter-cache-dir", metavar="DIR",
                   help="the store's disk cache (default: $LLAMAX_CACHE_DIR/adapter-store/...)")
    p.add_argument("--adapter-cache-bytes", type=_bytes, default=10 << 30, metavar="N",
                   help="the disk cache's bound, least recently used out first (default 10G; K, M, G suffixes)")
    p.add_argument("--adapter-store-ttl", type=float, default=60.0, metavar="S",
                   help="seconds before a store adapter is looked up again (a newer version then loads; "
                        "default 60)")
    p.add_argument("--adapter-max-bytes", type=_bytes, default=1 << 30, metavar="N",
                   help="a store adapter bigger than this is refused (default 1G)")
    p.add_argument("--adapter-max-rank", type=int, default=None, metavar="R",
                   help="a store adapter of larger rank is refused (default: any)")
    p.add_argument("--adapter-store-timeout", type=float, default=30.0, metavar="S",
                   help="a store lookup and fetch slower than this is a 503 (default 30)")
    p.add_argument("--adapter-fetch-workers", type=int, default=4, metavar="N",
                   help="store fetches and loads at once (default 4)")
    p.add_argument("--prefix-cache", choices=("any", "exact", "off"), default="any",
                   help="prompt prefix reuse: any common prefix, token by token (default, as llama-server); "
                        "exact: whole 256-token chunks, a cached answer bit for bit the cold one; off")
    p.add_argument("--lora-scaled", action="append", nargs=2, default=[], metavar=("[NAME=]PATH", "SCALE"),
                   help="an adapter loaded at start and in the default set with SCALE: requests that name no "
                        "adapter get it (llama-server's --lora-scaled; repeatable)")
    p.add_argument("--control-vector", action="append", type=_named, default=[], metavar="NAME=PATH",
                   help="a control vector GGUF, named (repeatable)")
    p.add_argument("--api-key", action="append", default=[], help="an API key (repeatable; also LLAMAX_API_KEY)")
    p.add_argument("--api-key-file", help="a file with one API key per line")
    p.add_argument("--admin-api-key", action="append", default=[],
                   help="a key for management routes (repeatable; also LLAMAX_ADMIN_API_KEY)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="enable /v1/load_lora_adapter and /v1/unload_lora_adapter (admin key, --lora-dir)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait beyond the running ones; more get 503 (default 64)")
    p.add_argument("--metrics", action="store_true", help="enable GET /metrics (Prometheus)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="request body limit (default 8 MiB)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may run before it is cancelled (default 600)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGINT/SIGTERM, seconds running requests get to finish before they are "
                        "cancelled (default 10)")
    p.add_argument("--chat-format", help="a built-in chat format instead of the GGUF's template")
    p.add_argument("--chat-template", metavar="FILE|NAME|TEXT",
                   help="a Jinja2 chat template file instead of the GGUF's, a built-in format's name (chatml, "
                        "llama2, llama3, gemma, ... as llama-server names them), or the template's text")
    p.add_argument("--verbose", action="store_true", help="llama.cpp's log and an access log")
    p.add_argument("--deterministic", action="store_true",
                   help="bit-identical answers whatever a request is batched with and whatever prefix the cache "
                        "reused (ggml's reference CPU kernels: decode a few percent slower, long prompts ~20%% "
                        "slower; docs/determinism.md)")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="thinking budget of chat requests that set none: the <think> section is closed after N "
                        "tokens (0: at once; -1: no budget, the default); a request's max_reasoning_tokens "
                        "(llama-server: thinking_budget_tokens) wins")
    p.add_argument("--reasoning-budget-message", metavar="TEXT",
                   help="text put before the closing tag when the budget runs out (default: none)")
    p.add_argument("--max-lora-slots", type=int, default=None, metavar="N",
                   help="slots of the LoRA table: requests with different adapters share a decode at the cost "
                        "of one adapter, each token multiplied by its own adapters only (default: --parallel; "
                        "0: off, every decode runs the union of its adapters; docs/adapters.md)")
    p.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                   help="the largest adapter rank the LoRA table holds (default 16; higher ranks go the union "
                        "way); a table costs (N + 1) * R * (n_in + n_out) * 4 bytes per adapted weight")
    p.add_argument("--embedding", "--embeddings", action="store_true",
                   help="serve embeddings only (/v1/embeddings, /embedding): a generating model's hidden states "
                        "pooled; an encoder model (BERT family) is served this way without the flag")
    p.add_argument("--pooling", choices=("none", "mean", "cls", "last", "rank"), default=None,
                   help="the embeddings' pooling (default: the model's own, else mean); none: a vector per "
                        "token, on /embedding only (rank is refused: llamax serves no reranker yet)")
    t = p.add_argument_group("tenants (docs/tenants.md)")
    t.add_argument("--tenants", metavar="FILE",
                   help="a tenants file (TOML or JSON): keys, allowed adapters, weights, limits, cache scope; "
                        "reloaded on SIGHUP and POST /admin/tenants/reload")
    t.add_argument("--usage-log", metavar="FILE",
                   help="append a JSON line per answered model request (tenant, key id, adapters, tokens, "
                        "latency, status); rotated at 64 MiB, 5 kept; summed by GET /admin/usage")
    t.add_argument("--reserve-slots", type=int, default=None,
                   help="batch slots a tenant over its fair share leaves free, so another tenant's request "
                        "starts at once (default: 1 with --tenants, else 0)")
    m = p.add_argument_group("llama.cpp (llama-server's flags)")
    m.add_argument("--model", "-m", dest="model_flag", metavar="FILE", help="the GGUF model (llama-server's way)")
    m.add_argument("--ctx-size", type=int, default=None, metavar="N",
                   help="llama-server's context: N tokens of KV for all --parallel sequences (each gets N / "
                        "--parallel; with --kv-unified, up to N each); --n-ctx is llamax's per-request size")
    m.add_argument("--batch-size", "-b", type=int, default=None, help="tokens per decode (--n-batch)")
    m.add_argument("--ubatch-size", "-ub", type=int, default=None, help="physical batch size (llama.cpp's n_ubatch)")
    m.add_argument("--kv-unified", "-kvu", action="store_true",
                   help="with --ctx-size: each sequence may use the whole context (llama-server's unified KV)")
    m.add_argument("--seed", "-s", type=int, default=None,
                   help="the seed of requests that send none (default: random; -1: random)")
    for flag, name, kind in (("--temp", "temperature", float), ("--top-k", "top_k", int),
                             ("--top-p", "top_p", float), ("--min-p", "min_p", float),
                             ("--typical", "typical_p", float), ("--repeat-penalty", "repeat_penalty", float),
                             ("--presence-penalty", "presence_penalty", float),
                             ("--frequency-penalty", "frequency_penalty", float)):
        m.add_argument(flag, dest=f"default_{name}", type=kind, default=None, metavar="X",
                       help=f"the {name} of requests that send none (default: llama-server's)")
    m.add_argument("--n-predict", "-n", type=int, default=-1, metavar="N",
                   help="max tokens of a request that sets none (-1: up to the context; a tenant's cap wins)")
    m.add_argument("--slots", dest="slots", action="store_true", default=True, help="enable GET /slots (default)")
    m.add_argument("--no-slots", dest="slots", action="store_false", help="GET /slots answers 501")
    m.add_argument("--cors-origins", metavar="ORIGINS",
                   help="browser origins allowed to call the server: *, localhost (any localhost origin), or "
                        "origins, comma-separated (default: none; llama-server allows every origin)")
    m.add_argument("--reasoning", choices=("on", "off", "auto"), default="auto",
                   help="thinking in templates that offer it: on, off (enable_thinking false, and a thinking "
                        "budget of 0 where the request sets none), auto (the template's default)")
    m.add_argument("--reasoning-format", choices=("auto", "deepseek"), default="auto",
                   help="reasoning is split into reasoning_content (auto and deepseek: what llamax does)")
    m.add_argument("--chat-template-file", metavar="FILE", help="a Jinja2 chat template file instead of the GGUF's")
    m.add_argument("--tags", metavar="A,B", help="labels on the model's /v1/models card (llama-server's)")
    m.add_argument("--any-model", action="store_true",
                   help="a request naming a model this server does not know gets the base model, as on "
                        "llama-server (clients that send a fixed model name: Claude Code, ...); default: 404")
    m.add_argument("--jinja", action="store_true", help="accepted: llamax always renders Jinja2 templates")
    m.add_argument("--no-jinja", action="store_true",
                   help="accepted with a notice: llamax always renders the model's Jinja2 template")
    m.add_argument("--offline", action="store_true", help="accepted: llamax never downloads anything")
    m.add_argument("--cont-batching", "-cb", action="store_true", help="accepted: llamax always batches")
    m.add_argument("--no-ui", action="store_true", help="accepted: llamax serves no web UI")
    # llama-server's flags llamax refuses, each with its reason (not silently ignored)
    m.add_argument("--context-shift", action="store_true", help="refused: llamax never shifts the context")
    m.add_argument("--slot-save-path", metavar="DIR", help="refused: llamax's slots share one prefix cache")
    m.add_argument("--cache-ram", "-cram", type=int, default=None, metavar="MiB",
                   help="refused: llamax keeps cached prefixes in the contexts' KV (--prefix-cache)")
    m.add_argument("--reranking", "--rerank", action="store_true", help="refused: llamax serves no reranker yet")
    m.add_argument("--sleep-idle-seconds", type=float, default=-1, metavar="N",
                   help="let the model go after N seconds without a request (its memory freed); the next "
                        "request loads it again (default -1: never)")
    m.add_argument("--cache-type-k", "-ctk", help="KV cache type for K: f16 (default), bf16, f32, q8_0, q5_1, "
                   "q5_0, q4_1, q4_0, iq4_nl")
    m.add_argument("--cache-type-v", "-ctv", help="KV cache type for V (a quantized one needs flash attention)")
    m.add_argument("--flash-attn", "-fa", choices=("on", "off", "auto"), default="auto",
                   help="flash attention (default auto: llama.cpp decides)")
    m.add_argument("--rope-scaling", choices=("none", "linear", "yarn"), help="RoPE scaling (default: the model's)")
    m.add_argument("--rope-scale", type=float, help="RoPE context scaling factor: --rope-freq-scale 1/N")
    m.add_argument("--rope-freq-base", type=float, help="RoPE base frequency (default: the model's)")
    m.add_argument("--rope-freq-scale", type=float, help="RoPE frequency scaling factor (default: the model's)")
    m.add_argument("--yarn-orig-ctx", type=int, help="YaRN: the model's original context size")
    m.add_argument("--yarn-ext-factor", type=float, help="YaRN: extrapolation mix factor")
    m.add_argument("--yarn-attn-factor", type=float, help="YaRN: magnitude scaling factor")
    m.add_argument("--yarn-beta-slow", type=float, help="YaRN: high correction dim")
    m.add_argument("--yarn-beta-fast", type=float, help="YaRN: low correction dim")
    m.add_argument("--override-kv", action="append", type=_override, default=[], metavar="KEY=TYPE:VALUE",
                   help="override model metadata (TYPE: int, float, bool, str; the keys llamax allows are "
                        "listed in docs/guide.md); repeatable")
    g = p.add_argument_group("Ray Serve (extra: ray)")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve from R Ray Serve replicas with adapter affinity (each loads the model)")
    g.add_argument("--max-adapter-sets", type=int, default=None,
                   help="adapter sets Ray Serve's router remembers per replica (its multiplexed models: the "
                        "least recently used forgotten; the adapters themselves are bounded by "
                        "--max-loaded-adapters) (default 4)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto, or HEAD:6379) instead of starting a local one")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="Ray's logical CPUs per replica (scheduling; default 1)")


def _keys(args) -> tuple[list[str], list[str]]:
    keys = list(args.api_key)
    if os.environ.get("LLAMAX_API_KEY"):
        keys.append(os.environ["LLAMAX_API_KEY"])
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as f:
            keys += [line.strip() for line in f if line.strip() and not line.startswith("#")]
    admin = list(args.admin_api_key)
    if os.environ.get("LLAMAX_ADMIN_API_KEY"):
        admin.append(os.environ["LLAMAX_ADMIN_API_KEY"])
    return keys, admin


def server_config(args):
    """The ServerConfig the parsed options describe (ValueError if they don't fit)."""
    keys, admin = _keys(args)
    scaled, scales = _scaled(args.lora_scaled)
    for flag, given, why in (
            ("--context-shift", args.context_shift, "llamax never shifts the context: a reply ends where the "
             "context does (finish_reason length), and a prompt over it is a 400"),
            ("--slot-save-path", args.slot_save_path, "llamax's slots share one prefix cache (a request reuses "
             "any cached prefix whatever slot it runs in), so there is no slot's KV to save or restore by id"),
            ("--cache-ram", args.cache_ram, "llamax keeps cached prefixes in the contexts' KV (--prefix-cache "
             "any|exact|off); a RAM cache of saved states is the library's LlamaRAMCache"),
            ("--reranking", args.reranking, "llamax serves no reranker yet (/rerank)")):
        if given:
            raise ValueError(f"{flag} is not supported: {why}")
    if (args.model is None) == (args.model_flag is None):
        raise ValueError("give the model once: MODEL.gguf, or -m/--model MODEL.gguf")
    model = args.model if args.model is not None else args.model_flag
    template, chat_format = _chat_template(args)
    if args.chat_format is not None:
        if chat_format is not None:
            raise ValueError("give --chat-format or a built-in --chat-template name, not both")
        chat_format = args.chat_format
    n_ctx = args.n_ctx
    if args.ctx_size is not None:
        if args.n_ctx != 4096:
            raise ValueError("give --n-ctx (per request) or --ctx-size (llama-server's: for all slots), not both")
        if args.ctx_size < 1:
            raise ValueError("--ctx-size must be >= 1")
        n_ctx = args.ctx_size if args.kv_unified else max(1, args.ctx_size // max(1, args.parallel))
    elif args.kv_unified:
        raise ValueError("--kv-unified means something with --ctx-size only (--n-ctx is per request already)")
    if args.batch_size is not None and args.n_batch != 512:
        raise ValueError("give --n-batch or --batch-size, not both")
    if args.no_jinja:
        print("python -m llamax serve: --no-jinja: llamax always renders the model's Jinja2 chat template",
              file=sys.stderr)
    defaults = {k[len("default_"):]: v for k, v in vars(args).items() if k.startswith("default_") and v is not None}
    return ServerConfig(model=model, host=args.host, port=args.port, alias=args.alias,
                        n_contexts=args.n_contexts, parallel=args.parallel, n_ctx=n_ctx,
                        n_batch=args.n_batch if args.batch_size is None else args.batch_size,
                        threads=args.threads, sampling_defaults=defaults, n_predict=args.n_predict,
                        slots=args.slots, cors_origins=args.cors_origins, any_model=args.any_model,
                        tags=[t.strip() for t in (args.tags or "").split(",") if t.strip()],
                        sleep_idle_seconds=None if args.sleep_idle_seconds == -1 else args.sleep_idle_seconds,
                        enable_thinking={"on": True, "off": False, "auto": None}[args.reasoning], n_gpu_layers=args.n_gpu_layers, loras=args.lora + scaled, lora_dir=args.lora_dir,
                        max_loaded_adapters=args.max_loaded_adapters, control_vectors=args.control_vector,
                        prefix_cache=args.prefix_cache,
                        api_keys=keys, admin_api_keys=admin, allow_runtime_lora=args.allow_runtime_lora,
                        max_queue=args.max_queue, metrics=args.metrics, max_body_bytes=args.max_body_bytes,
                        request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
                        chat_format=chat_format, chat_template=template, verbose=args.verbose,
                        lora_scales=scales, llama_options=llama_options(args), tenants=args.tenants,
                        usage_log=args.usage_log, reserve_slots=args.reserve_slots,
                        reasoning_budget=args.reasoning_budget, reasoning_budget_message=args.reasoning_budget_message,
                        deterministic=args.deterministic, embedding=args.embedding, pooling=args.pooling,
                        adapter_store=args.adapter_store, adapter_cache_dir=args.adapter_cache_dir,
                        adapter_cache_bytes=args.adapter_cache_bytes, adapter_store_ttl=args.adapter_store_ttl,
                        adapter_max_bytes=args.adapter_max_bytes, adapter_max_rank=args.adapter_max_rank,
                        adapter_store_timeout=args.adapter_store_timeout,
                        adapter_fetch_workers=args.adapter_fetch_workers)


def _bytes(text: str) -> int:
    """A byte count: 1048576, 512K, 100M, 10G (powers of 1024)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    try:
        n = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes (1048576) or a size with K, M, G or T") from None
    if not n >= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1 byte")
    return int(n)


def ray_options(args):
    """The RayOptions of the parsed options (ValueError if they don't fit)."""
    if args.metrics:
        raise ValueError("--metrics is for the single-process server; on Ray Serve, use Ray's own Prometheus "
                         "metrics (they include the multiplexing counters)")
    opts = RayOptions(replicas=1 if args.replicas is None else args.replicas,
                      max_sets=4 if args.max_adapter_sets is None else args.max_adapter_sets,
                      max_adapters=8 if args.max_loaded_adapters is None else args.max_loaded_adapters,
                      replica_cpus=args.replica_cpus)
    if opts.replicas < 1 or opts.max_sets < 1 or opts.max_adapters < 1 or opts.replica_cpus <= 0:
        raise ValueError("--replicas, --max-loaded-adapters, --max-adapter-sets and --replica-cpus must be "
                         "positive")
    return opts
