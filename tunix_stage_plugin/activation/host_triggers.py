"""Which imports the env-gated bootstrap watches, per host: a static table, read at start-up.

Loading the host adapters through their entry points needs importlib.metadata to scan every
installed distribution (~40 ms per interpreter start), so the bootstrap watches these module names
instead and loads the adapter only when one of them is imported. A test keeps the table equal to
the registered adapters' `trigger_modules`. A host adapter that is not listed here is installed
through `tunix_stage_plugin.install(host=...)` (README "Activation").
"""

HOST_TRIGGERS: dict[str, tuple[str, ...]] = {
    "tunix": (
        "tunix.experimental.worker.remote_execution",
        "tunix.experimental.worker.trainer_worker",
        "tunix.experimental.orchestrator.distributed_rl_engine",
        "tunix.experimental.orchestrator.rl_program",
    ),
    "maxtext": ("maxtext.training_engine.maxtext_engine",),
}
