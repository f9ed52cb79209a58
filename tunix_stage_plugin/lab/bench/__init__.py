"""`tunix-stage bench`: the staging A/B on the embedded host (runner, metrics, report, plot, trace).

Nothing here imports JAX: the trainer runs in its own process (tunix_stage_plugin.lab.embedded).
"""
