"""llama-cpp-python's server settings, for ``python -m llamax.server``: its
flags (``--model``, ``--n_ctx``, ``--config_file``, ...) and its config file
(JSON, or YAML with PyYAML installed: server settings plus a ``models``
list, several models served by one process and chosen by ``model``).

Every setting is taken, mapped onto :class:`ServerConfig` or a
``llamax.Llama`` keyword, or refused with the reason -- never ignored.
Settings that change nothing here are accepted at the values that mean
what llamax does anyway (``logits_all``, ``embedding``, ``use_mmap``...).
Standard library only (YAML through PyYAML when a file needs it)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from llamax.server.config import ServerConfig

__all__ = ["parse", "configs_from_settings", "load_config_file"]

# llama-cpp-python's model setting -> (where it goes, the name there, its type).
# "cfg": a ServerConfig field; "llama": a llamax.Llama keyword (ServerConfig.llama_options).
_MODEL = {
    "model": ("cfg", "model", str), "model_alias": ("cfg", "alias", str),
    "n_gpu_layers": ("cfg", "n_gpu_layers", int), "n_ctx": ("cfg", "n_ctx", int),
    "n_batch": ("cfg", "n_batch", int), "n_threads": ("cfg", "threads", int),
    "chat_format": ("cfg", "chat_format", str), "verbose": ("cfg", "verbose", bool),
    "n_ubatch": ("llama", "n_ubatch", int), "n_threads_batch": ("llama", "n_threads_batch", int),
    "seed": ("llama", "seed", int), "last_n_tokens_size": ("llama", "last_n_tokens_size", int),
    "split_mode": ("llama", "split_mode", int), "main_gpu": ("llama", "main_gpu", int),
    "tensor_split": ("llama", "tensor_split", list), "use_mlock": ("llama", "use_mlock", bool),
    "rope_scaling_type": ("llama", "rope_scaling_type", int), "rope_freq_base": ("llama", "rope_freq_base", float),
    "rope_freq_scale": ("llama", "rope_freq_scale", float), "yarn_ext_factor": ("llama", "yarn_ext_factor", float),
    "yarn_attn_factor": ("llama", "yarn_attn_factor", float), "yarn_beta_fast": ("llama", "yarn_beta_fast", float),
    "yarn_beta_slow": ("llama", "yarn_beta_slow", float), "yarn_orig_ctx": ("llama", "yarn_orig_ctx", int),
    "offload_kqv": ("llama", "offload_kqv", bool), "flash_attn": ("llama", "flash_attn", bool),
    "type_k": ("llama", "type_k", int), "type_v": ("llama", "type_v", int), "numa": ("llama", "numa", bool),
    "kv_overrides": ("overrides", "kv_overrides", list), "lora_path": ("lora", "lora_path", str),
    "lora_scale": ("lora", "lora_scale", float),
}
# Settings that change nothing in llamax, accepted at the values that say so.
_INERT = {
    "vocab_only": (False,), "use_mmap": (True,), "logits_all": (True, False), "embedding": (True, False),
    "mul_mat_q": (True, False), "lora_base": (None,), "rpc_servers": (None,), "clip_model_path": (None,),
    "chat_template_kwargs": (None,), "cache": (False,), "cache_type": ("ram", "disk"), "cache_size": None,
    "hf_tokenizer_config_path": (None,), "hf_pretrained_model_name_or_path": (None,), "hf_model_repo_id": (None,),
    "draft_model": (None,), "draft_model_num_pred_tokens": None,
}
_WHY = {
    "clip_model_path": "multimodal models need llama.cpp's mtmd library, which llamax does not build",
    "vocab_only": "a server without weights cannot answer", "use_mmap": "llamax always maps the file",
    "cache": "llamax's prefix cache is always on (--prefix-cache)", "draft_model": "use the library's draft_model",
    "lora_base": "llama.cpp applies adapters to the loaded model",
}
_SERVER = {"host": str, "port": int, "api_key": str, "interrupt_requests": bool, "disable_ping_events": bool,
           "root_path": str, "ssl_keyfile": str, "ssl_certfile": str}
# (llama-cpp-python's server defaults where they differ from python -m llamax serve's)
_DEFAULTS = {"host": "localhost", "port": 8000, "n_ctx": 2048}


def _bool(v) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "1", "yes", "false", "0", "no"):
        return v.lower() in ("true", "1", "yes")
    raise ValueError(f"{v!r} is not true or false")


def _typed(name: str, kind, v):
    if v is None:
        return None
    try:
        if kind is bool:
            return _bool(v)
        if kind is int and not isinstance(v, bool):
            return int(v)
        if kind is float and not isinstance(v, bool):
            return float(v)
        if kind is str:
            return str(v)
        if kind is list:
            return list(v) if isinstance(v, (list, tuple)) else [x.strip() for x in str(v).split(",") if x.strip()]
    except (TypeError, ValueError):
        pass
    raise ValueError(f"{name}={v!r}: expected {getattr(kind, '__name__', kind)}")


def _kv_overrides(items: list) -> dict:
    """llama-cpp-python's "key=type:value" overrides (type: bool, int, float, str)."""
    out = {}
    for item in items:
        key, eq, rest = str(item).partition("=")
        kind, colon, raw = rest.partition(":")
        if not key or not eq or not colon or kind not in ("bool", "int", "float", "str"):
            raise ValueError(f"kv_overrides entry {item!r}: expected key=type:value (type: bool, int, float, str)")
        if kind == "bool":
            out[key] = raw.lower() in ("true", "1")   # (llama-cpp-python's reading: anything else is false)
        else:
            out[key] = {"int": int, "float": float, "str": str}[kind](raw)
    return out


def configs_from_settings(server: dict, models: list[dict]) -> list[ServerConfig]:
    """One ServerConfig per model, each with the server's settings."""
    common: dict = {"host": _DEFAULTS["host"], "port": _DEFAULTS["port"]}
    for k, v in server.items():
        if k not in _SERVER:
            raise ValueError(f"unknown server setting {k!r} (llama-cpp-python's: {', '.join(_SERVER)})")
        v = _typed(k, _SERVER[k], v)
        if k in ("host", "port"):
            common[k] = v
        elif k == "api_key":
            if v:
                common["api_keys"] = [v]
        elif k == "interrupt_requests" and v is False:
            raise ValueError("interrupt_requests=false: llamax always lets a request run beside the others")
        elif k == "disable_ping_events" and v is True:
            raise ValueError("disable_ping_events=true: llamax's streams always send keep-alive pings")
        elif k == "root_path" and v:
            raise ValueError("root_path: serve llamax behind a proxy that strips the prefix")
        elif k in ("ssl_keyfile", "ssl_certfile") and v:
            raise ValueError(f"{k}: llamax serves plain HTTP; terminate TLS in a proxy in front of it")
    if not models:
        raise ValueError("no model: pass --model PATH or a config file with a 'models' list")
    out = []
    aliases = set()
    for i, m in enumerate(models):
        kw: dict = dict(common, n_ctx=_DEFAULTS["n_ctx"])
        llama: dict = {}
        loras: list = []
        scales: dict = {}
        lora_path = lora_scale = None
        for k, v in m.items():
            if k in _INERT:
                allowed = _INERT[k]
                if allowed is not None and any(isinstance(a, bool) for a in allowed):
                    try:
                        v = _bool(v)
                    except ValueError:
                        pass
                if allowed is not None and v not in allowed:
                    raise ValueError(f"models[{i}].{k}={v!r}: " + _WHY.get(k, f"only {allowed!r} is supported"))
                continue
            if k not in _MODEL:
                raise ValueError(f"models[{i}]: unknown setting {k!r}")
            where, name, kind = _MODEL[k]
            v = _typed(k, kind, v)
            if v is None:
                continue
            if where == "cfg":
                kw[name] = v
            elif where == "llama":
                llama[name] = [_typed(k, float, x) for x in v] if k == "tensor_split" else v
            elif where == "overrides":
                llama["kv_overrides"] = _kv_overrides(v)
            elif k == "lora_path":
                lora_path = v
            else:
                lora_scale = v
        if "model" not in kw:
            raise ValueError(f"models[{i}] has no 'model' (its path)")
        if lora_path is not None:
            name = Path(lora_path).stem
            loras.append((name, lora_path))
            scales[name] = 1.0 if lora_scale is None else lora_scale
        elif lora_scale is not None:
            raise ValueError(f"models[{i}]: lora_scale goes with lora_path")
        kw["alias"] = kw.get("alias") or Path(kw["model"]).stem
        if kw["alias"] in aliases:
            raise ValueError(f"two models are called {kw['alias']!r}: give them model_alias")
        aliases.add(kw["alias"])
        out.append(ServerConfig(loras=loras, lora_scales=scales, llama_options=llama, **kw))
    return out


def load_config_file(path: str) -> tuple[dict, list[dict]]:
    """(server settings, model settings list) of a llama-cpp-python config file."""
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{path}: a YAML config file needs PyYAML (pip install pyyaml), or write it as "
                             "JSON") from None
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("models", []), list):
        raise ValueError(f"{path}: expected an object with server settings and a 'models' list")
    models = data.pop("models", [])
    if not all(isinstance(m, dict) for m in models):
        raise ValueError(f"{path}: each entry of 'models' is an object of model settings")
    return data, models


def parse(argv=None) -> list[ServerConfig]:
    """The ServerConfigs ``python -m llamax.server``'s arguments describe
    (ValueError if they don't fit)."""
    p = argparse.ArgumentParser(prog="python -m llamax.server",
                                description="llamax's server with llama-cpp-python's server settings "
                                            "(python -m llamax serve has llamax's own)")
    p.add_argument("--config_file", help="a JSON (or YAML) file: server settings and a 'models' list")
    for k in _SERVER:
        p.add_argument(f"--{k}")
    for k in list(_MODEL) + list(_INERT):
        p.add_argument(f"--{k}", action="append" if k == "kv_overrides" else "store")
    args = vars(p.parse_args(argv))
    config_file = args.pop("config_file") or os.environ.get("CONFIG_FILE")
    given = {k: v for k, v in args.items() if v is not None}
    if config_file:
        if given:
            raise ValueError(f"--config_file and other settings ({', '.join(sorted(given))}): put them in the file")
        server, models = load_config_file(config_file)
    else:
        server = {k: v for k, v in given.items() if k in _SERVER}
        model = {k: v for k, v in given.items() if k not in _SERVER}
        models = [model] if model else []
    return configs_from_settings(server, models)
