"""The application's adapter table on Ray Serve: one replica that every
other deployment reads, so replicas can't drift apart; and the set keys
(Ray Serve's multiplexed model ids) that name adapter sets."""
from __future__ import annotations

import secrets
import urllib.parse

import ray
from ray import serve

__all__ = ["AdapterDirectory", "set_key", "set_names", "STORE_PREFIX"]

# the path the registry keeps for an adapter of --adapter-store: "store:<version>"
# (the ingress looked it up; each replica fetches it into its own disk tier)
STORE_PREFIX = "store:"


def set_key(loras: list[dict] | None) -> str:
    """The multiplexed model id of an adapter set: its names, sorted, each
    URL-quoted (a name may hold '+'), joined by '+'; '' for the base model."""
    if not loras:
        return ""
    return "+".join(sorted({urllib.parse.quote(s["name"], safe="") for s in loras}))


def set_names(key: str) -> list[str]:
    return [urllib.parse.unquote(n) for n in key.split("+")] if key else []


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class AdapterDirectory:
    """Adapters registered for the whole application.  A snapshot is
    identified by (epoch, version): the epoch changes when this actor is
    restarted (its table is rebuilt from the command line then)."""

    def __init__(self, loras: list[tuple[str, str]], default_set: list[dict] | None = None):
        self.epoch = secrets.token_hex(4)
        self.version = 0
        self.ids: dict[str, int] = {}
        self.paths: dict[str, str] = {}
        self.next_id = 0
        self.default_set: list[dict] = []
        self.holders: dict[str, set[str]] = {}   # adapter -> replicas that hold it now
        self.loads: dict[str, int] = {}          # adapter -> loads, over all replicas, ever
        for name, path in loras:
            self._add(name, path)
        self.default_set = list(default_set or [])

    def _add(self, name: str, path: str) -> None:
        if name not in self.ids:
            self.ids[name] = self.next_id
            self.next_id += 1
        self.paths[name] = path
        self.version += 1

    def snapshot(self) -> dict:
        return {"id": (self.epoch, self.version), "ids": dict(self.ids), "paths": dict(self.paths),
                "default_set": list(self.default_set)}

    def register(self, name: str, path: str) -> dict:
        self._add(name, path)   # an existing name keeps its id (load_inplace)
        return self.snapshot()

    def unregister(self, name: str) -> dict:
        if name in self.ids:
            del self.ids[name], self.paths[name]
            self.default_set = [s for s in self.default_set if s["name"] != name]
            self.version += 1
        return self.snapshot()

    def set_default(self, default_set: list[dict]) -> dict:
        self.default_set = list(default_set)
        self.version += 1
        return self.snapshot()

    def held(self, replica: str, name: str, loaded: bool) -> None:
        """A replica loaded (or unloaded) an adapter."""
        s = self.holders.setdefault(name, set())
        if loaded:
            s.add(replica)
            self.loads[name] = self.loads.get(name, 0) + 1
        else:
            s.discard(replica)

    def stats(self) -> dict:
        """Who holds what (replicas that have died are left out) and the
        load counts."""
        app = serve.get_replica_context().app_name
        alive = {}
        for replicas in self.holders.values():
            for r in list(replicas):
                if r not in alive:
                    try:
                        ray.get_actor(f"SERVE_REPLICA::{app}#LlamaReplica#{r}", namespace="serve")
                        alive[r] = True
                    except ValueError:  # a dead actor's name is gone
                        alive[r] = False
                if not alive[r]:
                    replicas.discard(r)
        return {"holders": {k: sorted(v) for k, v in self.holders.items()}, "loads": dict(self.loads)}
