"""The old name of :mod:`llamax.server.ray`, kept so that Serve config files
and ``serve run llamax.serve_ray:app_builder`` keep working."""
from llamax.server.ray import APP_NAME, REPLICA_HEADER, RayOptions, ServerConfig, app_builder, build, deploy, run

__all__ = ["APP_NAME", "REPLICA_HEADER", "RayOptions", "ServerConfig", "app_builder", "build", "deploy", "run"]
