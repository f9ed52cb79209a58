"""Host-neutral core: configuration, staged-batch store, method executor, stage pipeline, telemetry.

Nothing here imports a host (tunix, MaxText) or JAX, so it is tested everywhere.
"""
