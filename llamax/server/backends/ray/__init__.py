"""The Ray Serve backend: :mod:`.registry` (the application's adapter
table), :mod:`.replica` (a model and the single-process app per replica),
:mod:`.ingress` (the route table's backend at the front).  Built and run
by :mod:`llamax.server.ray`."""
