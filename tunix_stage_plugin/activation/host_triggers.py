"""Which imports the env-gated bootstrap watches, per host: a static table, read at start-up.

Loading the host adapters through their entry points needs importlib.metadata to scan every
installed distribution (~40 ms per interpreter start), so the bootstrap watches these module names
instead and loads the adapter only when one of them is imported. A test keeps the table equal to
the registered adapters' `trigger_modules`. A host adapter that is not listed here is installed
through `tunix_stage_plugin.install(host=...)` (docs/tunix.md "Activation, three ways").

The second table names the drivers known to take the staging flags: the bootstrap watches the
modules of those whose flags the plugin adds (docs/tunix.md, "Driver flags").
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


class Driver:
  """A driver known to take the staging flags (--stage_train_batches, --max_staged_batches, ...).

  `parse` names the module-level function that parses the driver's command line, the one the
  plugin makes take the staging flags once the module is imported (activation/drivers.py); None:
  the driver defines the flags itself.
  """

  __slots__ = ("module", "host", "parse", "about")

  def __init__(self, module: str, host: str, parse: str | None, about: str) -> None:
    self.module = module
    self.host = host
    self.parse = parse
    self.about = about

  def __repr__(self) -> str:
    return f"Driver({self.module!r})"


# The launch recipes pass the staging flags only to these drivers (`tunix-stage config
# --flags_for orchestrator --driver MAIN`); any other driver reads the staging variables only.
KNOWN_DRIVERS: tuple[Driver, ...] = (
    Driver("tunix.experimental.examples.deepswe_dist.run_deepswe_dist", "tunix", "_parse_args",
           "tunix's DeepSWE GRPO driver (newer tunix main)"),
    Driver("tunix.experimental.examples.math_gsm8k_dist.run_gsm8k_dist_grpo", "tunix",
           "_parse_args", "tunix's GSM8K GRPO driver"),
    Driver("tunix_stage_plugin.embedded.orchestrator_main", "embedded", None,
           "the embedded host's orchestrator"),
)
