"""The tunix adapter object the `tunix_stage_plugin.hosts` entry point names; while installed it
holds the installation (installation.py), the state of the hooks it applied."""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from tunix_stage_plugin.hosts import triggers
from tunix_stage_plugin.hosts import version

if TYPE_CHECKING:
  from tunix_stage_plugin.core import patching
  from tunix_stage_plugin.core import config as config_lib
  from tunix_stage_plugin.hosts.probing import Probe
  from tunix_stage_plugin.hosts.tunix.installation import Installation

DIST = "google-tunix"
PEFT_TRAINER = "tunix.experimental.train.peft_trainer_v2"


@dataclasses.dataclass(frozen=True)
class Modules:
  remote_execution: ModuleType
  trainer_worker: ModuleType
  engine: ModuleType
  program: ModuleType
  peft_trainer: ModuleType


class TunixAdapter:
  name = "tunix"
  # remote_execution, trainer_worker, distributed_rl_engine, rl_program: the order of Modules.
  trigger_modules = triggers.HOST_TRIGGERS["tunix"]
  HOOK_GROUPS = (
      "server: trainer methods off the event loop, a chunked stream for calls over the "
      "message cap",
      "worker: stage_batch/reset_staged/fwd_bwd(stage_key), fwd_bwd and update "
      "observed",
      "engine: stage_train_batch/reset_staged_batches/per_token_logps",
  )

  def __init__(self) -> None:
    self._modules: Modules | None = None
    self._installation: Installation | None = None

  @property
  def installation(self) -> Installation:
    """The active installation's state (tests, the tunix bench node and doctor read it)."""
    if self._installation is None:
      raise RuntimeError("the tunix staging hooks are not installed")
    return self._installation

  @property
  def hook_groups(self) -> tuple[str, ...]:
    """The hook groups; the program's names the train loop's way once tunix is loaded."""
    loop = "staged train loop" if self._modules is None else self.describe_loop()
    return (*self.HOOK_GROUPS,
            f"program: {loop}, _stage_ahead_while_pending/_prestage_across_boundary")

  def loop_way(self) -> str:
    """How the train loop is staged in this tunix (probes.SEAM or probes.COPY)."""
    # pylint: disable-next=import-outside-toplevel
    from tunix_stage_plugin.hosts.tunix import probes
    return probes.loop_way(self.modules.program.StandardRLProgram)

  def describe_loop(self) -> str:
    """The train loop's way in words (the activation line and doctor say it)."""
    # pylint: disable-next=import-outside-toplevel
    from tunix_stage_plugin.hosts.tunix import probes
    return probes.describe_loop(self.loop_way())

  @property
  def modules(self) -> Modules:
    if self._modules is None:
      raise RuntimeError("tunix adapter: call load() first")
    return self._modules

  def load(self) -> None:
    # All four at once, even when one triggered the install: the hooks are one unit, so a
    # trainer process that never builds a program still gets the program probed and patched.
    self._modules = Modules(*(importlib.import_module(m)
                              for m in (*self.trigger_modules, PEFT_TRAINER)))

  def describe(self) -> str:
    module_file = self._modules.remote_execution.__file__ if self._modules else None
    return version.describe("tunix", DIST, module_file)

  def probe(self, config: config_lib.StageConfig) -> list[Probe]:
    # pylint: disable=import-outside-toplevel
    from tunix_stage_plugin.hosts.tunix import probes
    if self.loop_way() == probes.SEAM:  # only the way this tunix has is loaded
      from tunix_stage_plugin.hosts.tunix import loop_seam
      return probes.run(self.modules, config, loop_seam.PROBE)
    return probes.run(self.modules, config, probes.COPY_PROBE)

  def apply(self, registry: patching.PatchRegistry, live: config_lib.LiveConfig) -> None:
    # pylint: disable-next=import-outside-toplevel
    from tunix_stage_plugin.hosts.tunix import hooks, installation
    inst = self._installation = installation.Installation(live, self.modules, registry)
    registry.on_undo(self._uninstalled)  # lanes closed, staged batches dropped, channels closed
    hooks.apply(registry, inst)

  def _uninstalled(self) -> None:
    inst, self._installation = self._installation, None
    if inst is not None:
      inst.close()


ADAPTER = TunixAdapter()
