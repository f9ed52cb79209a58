"""The built-in hosts' module names: what installs each one (HOST_TRIGGERS, the one home of these
names: each adapter's `trigger_modules` and the bootstrap's watches), and the drivers known to take
the staging flags (KNOWN_DRIVERS; docs/tunix.md "Driver flags").

The bootstrap reads this module rather than the adapters because loading adapters (entry points,
importlib.metadata) costs ~100 ms per interpreter start; this module imports nothing. An adapter
not listed here is installed through `install(host=...)` (docs/tunix.md "Activation, three ways").
"""

TUNIX_REMOTE_EXECUTION = "tunix.experimental.worker.remote_execution"
TUNIX_TRAINER_WORKER = "tunix.experimental.worker.trainer_worker"
TUNIX_ENGINE = "tunix.experimental.orchestrator.distributed_rl_engine"
TUNIX_PROGRAM = "tunix.experimental.orchestrator.rl_program"
MAXTEXT_ENGINE = "maxtext.training_engine.maxtext_engine"

HOST_TRIGGERS: dict[str, tuple[str, ...]] = {
    "tunix": (TUNIX_REMOTE_EXECUTION, TUNIX_TRAINER_WORKER, TUNIX_ENGINE, TUNIX_PROGRAM),
    "maxtext": (MAXTEXT_ENGINE,),
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
    Driver("tunix_stage_plugin.lab.embedded.orchestrator_main", "embedded", None,
           "the embedded host's orchestrator"),
)


def find(main: str) -> Driver | None:
  """The known driver `main` names: its module, or something in it (`module.main`,
  `module:main`, as a runtime's --process_main names it); None when the plugin does not know it."""
  for driver in KNOWN_DRIVERS:
    if main == driver.module or main.startswith((f"{driver.module}.", f"{driver.module}:")):
      return driver
  return None


def hooked(host: str | None = None) -> tuple[Driver, ...]:
  """The known drivers whose flags the plugin adds (all hosts when `host` is None)."""
  return tuple(d for d in KNOWN_DRIVERS if d.parse is not None and host in (None, d.host))
