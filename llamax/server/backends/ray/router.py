"""Ray Serve's request router for the replicas, by adapter: a request goes
to a replica whose held adapter sets (Ray's multiplexed model ids) cover
its set's adapters while that replica has a free sequence; when every
holder is saturated (as many requests running as it has sequences,
``saturation``), it goes to the least loaded of the replicas holding the
fewest sets, which fetches and loads the adapters -- so a hot adapter ends
up on more replicas instead of queueing on one, and a cold one doesn't
evict a busy replica's adapters.  Requests without an id (the base model)
go to the less loaded of two replicas drawn at random (power of two
choices, as Ray's default router does).

Ray Serve's own multiplexed routing matches whole ids only, waits for a
holder until a timeout, and queues up to ``max_ongoing_requests`` there
(more than the replica's sequences, so that requests can wait for a
slot); this router spills at the replica's sequence count.  It reads the
multiplexing mixin's id -> replicas table (``MultiplexMixin``'s state;
ray is pinned to 2.60 in the ``ray`` extra).
"""
from __future__ import annotations

import random
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from llamax.server.backends.ray.registry import set_names

__all__ = ["AdapterRouter"]


class AdapterRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Holders first while they have a free sequence, then the least loaded."""

    saturation = 1

    def initialize_state(self, saturation: int = 1, **kwargs):
        self.saturation = max(1, int(saturation))

    def _load(self, r: RunningReplica) -> int:
        q = self.replica_queue_len_cache.get(r.replica_id)
        return 0 if q is None else q

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not key:
            # two at random, the less loaded first (the router probes both and takes one that accepts)
            two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
            return [sorted(two, key=self._load)] if two else []
        # Holders: the replicas whose held sets cover every adapter of this
        # set (a replica holding coder+sql and tax serves tax+sql without
        # loading anything); then those holding the fewest sets; the rest.
        # Each least loaded first, ties in random order (a fixed order would
        # send every new set to the same replica, to evict its sets).
        names = set(set_names(key))
        held: dict = {}
        for k, ids in self._multiplexed_model_id_to_replica_ids.items():
            for rid in ids:
                held.setdefault(rid, set()).update(set_names(k))
        holders = [r for r in candidate_replicas if names <= held.get(r.replica_id, set())]
        _, fewest, rest = self.rank_replicas_via_multiplex(candidate_replicas, key)
        taken = {r.replica_id for r in holders}
        fewest = [r for r in fewest if r.replica_id not in taken]
        rest = [r for r in rest if r.replica_id not in taken]
        holders, fewest, rest = (sorted(random.sample(rank, len(rank)), key=self._load)
                                 for rank in (holders, fewest, rest))
        free = [r for r in holders if self._load(r) < self.saturation]
        spill = [rank[:2] for rank in (fewest, rest) if rank]
        if free:
            # a holder with a free sequence; then the others, should it refuse
            return [free[:2], *spill]
        # every holder busy (or none holds the set's adapters): the least loaded
        # of those holding the fewest sets, then the rest, then the holders
        return [*spill, holders[:2]] if holders else spill
