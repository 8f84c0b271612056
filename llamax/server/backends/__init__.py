"""Where the routes' work is done: :mod:`.local` (one model in this
process) or :mod:`.ray` (Ray Serve replicas behind an ingress).  Both
offer the same operations, one per route (see ``llamax.server.routes``)."""
