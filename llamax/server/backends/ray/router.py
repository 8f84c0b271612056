"""Ray Serve's request router for the replicas, by adapter: a request whose
adapter set (its multiplexed model id) a replica holds goes there while
that replica has a free sequence; when every holder is saturated (as many
requests running as it has sequences, ``saturation``), it goes to the
least loaded other replica, which fetches and loads the adapters -- so a
hot adapter ends up on more replicas instead of queueing on one, and a
cold one doesn't evict a busy replica's adapters.  Requests without an id
(the base model) go to the less loaded of two replicas drawn at random
(power of two choices, as Ray's default router does).

Ray Serve's own multiplexed routing waits for a holder until a timeout
(and queues up to ``max_ongoing_requests`` there, which is more than the
replica's sequences so that requests can wait for a slot); this router
uses the replica's sequence count as the point to spill at.
"""
from __future__ import annotations

import random
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

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
        # Ray's ranks: the holders, the replicas holding the fewest sets, the
        # rest; each least loaded first, ties in random order (a fixed order
        # would send every new set to the same replica, to evict its sets)
        holders, fewest, rest = (sorted(random.sample(rank, len(rank)), key=self._load)
                                 for rank in self.rank_replicas_via_multiplex(candidate_replicas, key))
        free = [r for r in holders if self._load(r) < self.saturation]
        spill = [rank[:2] for rank in (fewest, rest) if rank]
        if free:
            # a holder with a free sequence; then the others, should it refuse
            return [free[:2], *spill]
        # every holder busy (or none holds the set): the least loaded of those
        # holding the fewest sets, then the rest, then the holders after all
        return [*spill, holders[:2]] if holders else spill
