"""The server's adapter table (names, ids, files, the default set) and the
rules every backend applies to it: which adapters a request body names,
what POST /lora-adapters sets, and what a runtime load is refused for."""
from __future__ import annotations

import numpy as np
from fastapi import Request

from llamax.server import protocol
from llamax.server.config import ServerConfig
from llamax.server.errors import APIError
from llamax.server.files import OpenedFile, open_inside
from llamax.server.tenants import ANONYMOUS, Tenant

__all__ = ["AdapterTable", "read_default_set", "check_load_names", "open_runtime_file", "check_runtime_load",
           "runtime_allowed", "without_paths", "model_cards"]


class AdapterTable:
    """The adapters a server offers: name -> id (never reused), name -> the
    file's path, and the default set (POST /lora-adapters: [{name, scale}]).
    Changed only on the event loop's thread (or before serving)."""

    def __init__(self):
        self.ids: dict[str, int] = {}
        self.paths: dict[str, str] = {}
        self.default_set: list[dict] = []
        self._next_id = 0

    def record(self, name: str, path: str) -> None:
        self.ids[name] = self._next_id
        self.paths[name] = path
        self._next_id += 1

    def forget(self, name: str) -> None:
        del self.ids[name]
        del self.paths[name]
        self.default_set = [s for s in self.default_set if s["name"] != name]

    def apply(self, snap: dict) -> None:
        """Take a Ray registry's snapshot (ids, paths, default set)."""
        self.ids, self.paths, self.default_set = snap["ids"], snap["paths"], snap["default_set"]

    def resolve(self, body: protocol.AdapterFields, alias: str, control_vectors: set[str],
                tenant: Tenant = ANONYMOUS, any_model: bool = False) -> tuple[list[dict] | None, list[dict] | None]:
        """(active_loras, control_vectors) for a request of ``tenant``: by
        ``model``, by ``active_loras`` or llama-server's ``lora``, else the
        tenant's default set (or the server's).  An adapter the tenant may
        not use is answered as one that does not exist: a 404, or with
        ``any_model`` (--any-model) the base model, as for any name the
        server does not know."""
        ids = {n: i for n, i in self.ids.items() if tenant.may_use_adapter(n)}
        target = None
        m = body.model
        if m is not None and m != alias:
            name = m[len(alias) + 1:] if m.startswith(alias + ":") else m
            if name in ids:
                target = name
            elif not any_model:
                raise APIError(404, f"the model {m!r} does not exist: this server serves {alias!r} and "
                               f"the adapters {sorted(ids)} (GET /v1/models lists them)",
                               param="model", code="model_not_found")
        if body.active_loras is not None and body.lora is not None:
            raise APIError(400, "pass active_loras (by name) or lora (by id), not both", param="lora")
        explicit = None
        if body.active_loras is not None:
            explicit = []
            for i, a in enumerate(body.active_loras):
                if a.name not in ids:
                    raise APIError(404, f"active_loras[{i}]: no adapter named {a.name!r} (known: "
                                   f"{sorted(ids)})", param="active_loras", code="adapter_not_found")
                explicit.append({"name": a.name, "scale": a.scale})
        elif body.lora is not None:
            by_id = {v: k for k, v in ids.items()}
            explicit = []
            for i, a in enumerate(body.lora):
                if a.id not in by_id:
                    raise APIError(404, f"lora[{i}]: no adapter with id {a.id} (GET /lora-adapters lists them)",
                                   param="lora", code="adapter_not_found")
                explicit.append({"name": by_id[a.id], "scale": a.scale})
        for spec in explicit or ():
            if not np.isfinite(spec["scale"]):
                raise APIError(400, "adapter scales must be finite numbers", param="active_loras")
        if target is not None:
            if explicit is None:
                loras = [{"name": target, "scale": 1.0}]
            elif target not in {s["name"] for s in explicit}:
                raise APIError(400, f"model names the adapter {target!r} but the adapter list does not "
                               f"include it: name it in both, or use model={alias!r} with the list",
                               param="model", code="adapter_mismatch")
            else:
                loras = explicit
        elif explicit is not None:
            loras = explicit
        elif tenant.default_adapters is not None:
            loras = [{"name": n, "scale": sc} for n, sc in tenant.default_adapters if n in ids]
        else:
            loras = [s for s in self.default_set if s["name"] in ids]
        limit = tenant.limits.max_adapters
        if limit is not None and len({s["name"] for s in loras if s["scale"] != 0.0}) > limit:
            raise APIError(400, f"the request names {len(loras)} adapters; this key may use at most {limit} "
                           "at once", param="active_loras", code="too_many_adapters")
        cvecs = None
        if body.control_vectors is not None:
            known = {n for n in control_vectors if tenant.may_use_control_vector(n)}
            cvecs = []
            for i, c in enumerate(body.control_vectors):
                if c.name not in known:
                    raise APIError(404, f"control_vectors[{i}]: no control vector named {c.name!r} (known: "
                                   f"{sorted(known)})", param="control_vectors", code="control_vector_not_found")
                if not np.isfinite(c.scale):
                    raise APIError(400, "control vector scales must be finite numbers", param="control_vectors")
                cvecs.append({"name": c.name, "scale": c.scale})
        return [s for s in loras if s["scale"] != 0.0] or None, cvecs



def without_paths(listing: list[dict]) -> list[dict]:
    """/lora-adapters entries as a user key sees them: no file paths (where
    the operator keeps files is none of a tenant's business)."""
    return [{k: v for k, v in e.items() if k != "path"} for e in listing]


async def read_default_set(request: Request, lora_ids: dict[str, int]) -> list[dict]:
    """POST /lora-adapters' body ([{id, scale}]) as a set [{name, scale}]."""
    try:
        raw = await request.json()
    except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep (found by the HTTP fuzzer)
        raise APIError(400, "the body is not valid JSON (or nests too deep)", code="invalid_request") from None
    if not isinstance(raw, list):
        raise APIError(400, "the body must be a list of {id, scale}", code="invalid_request")
    by_id = {v: k for k, v in lora_ids.items()}
    new = []
    seen = set()
    for i, item in enumerate(raw):
        try:
            spec = protocol.LoraById.model_validate(item)
        except Exception:
            raise APIError(400, f"[{i}] must be {{'id': int, 'scale': number}}", param=str(i)) from None
        if spec.id not in by_id:
            raise APIError(404, f"[{i}]: no adapter with id {spec.id}", param=str(i), code="adapter_not_found")
        if spec.id in seen:
            raise APIError(400, f"[{i}]: adapter id {spec.id} appears twice", param=str(i))
        if not np.isfinite(spec.scale):
            raise APIError(400, f"[{i}]: the scale must be a finite number", param=str(i))
        seen.add(spec.id)
        if spec.scale != 0.0:
            new.append({"name": by_id[spec.id], "scale": spec.scale})
    return new


def check_load_names(cfg: ServerConfig, body: protocol.LoadLoraRequest, known, *, taken: bool = True) -> None:
    """What a runtime load is refused for by its name: loads are off, the
    name is the alias, or (``taken``) it is in use without load_inplace."""
    runtime_allowed(cfg)
    name = body.lora_name
    if name == cfg.alias:
        raise APIError(400, f"an adapter may not be named like the model alias {cfg.alias!r}",
                       param="lora_name")
    if taken and name in known and not body.load_inplace:
        raise APIError(409, f"an adapter named {name!r} is already loaded (unload it first, or "
                       "pass load_inplace=true)", param="lora_name", code="adapter_exists")


def open_runtime_file(cfg: ServerConfig, body: protocol.LoadLoraRequest) -> OpenedFile:
    """The runtime load's file, opened once inside --lora-dir (400/404
    otherwise: llamax.server.files).  (A worker thread.)"""
    return open_inside(cfg.lora_dir, body.lora_path, param="lora_path")


def check_runtime_load(cfg: ServerConfig, body: protocol.LoadLoraRequest, known) -> str:
    """Everything a runtime load is refused for before the file is read,
    for a server that can't hand its loader a descriptor (the Ray ingress:
    replicas load by path); the file's real path.  The file is opened as a
    local load opens it, so the same paths are refused."""
    check_load_names(cfg, body, known, taken=False)
    with open_runtime_file(cfg, body) as f:
        real = f.real
    check_load_names(cfg, body, known)
    return real


def runtime_allowed(cfg: ServerConfig) -> None:
    if not cfg.allow_runtime_lora:
        raise APIError(403, "runtime adapter loading is off (start the server with --allow-runtime-lora)",
                       code="runtime_lora_disabled")


def model_cards(cfg: ServerConfig, created: int, listing: list[dict], admin: bool) -> list[dict]:
    """/v1/models: the base model, then one card per adapter (vLLM's
    shape).  ``root`` is the file's path for an admin key only; others see
    the card's id there."""
    base = {"id": cfg.alias, "object": "model", "created": created, "owned_by": "llamax",
            "root": cfg.model if admin else cfg.alias, "parent": None, "max_model_len": cfg.n_ctx,
            "aliases": [cfg.alias, *cfg.aliases], "tags": list(cfg.tags)}
    cards = [base]
    for e in listing:
        cards.append({"id": e["name"], "object": "model", "created": created, "owned_by": "llamax",
                      "root": e["path"] if admin else e["name"], "parent": cfg.alias, "max_model_len": cfg.n_ctx,
                      "loaded": e["loaded"]})
    return cards
