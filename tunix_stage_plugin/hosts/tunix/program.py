"""StandardRLProgram: the staged train loop, used only when staging is on and the engine can stage.

Either way the loop is one staged run (run.py), in by what this tunix has (probes.loop_way): SEAM,
the hooks in loop_seam.py; COPY (tunix c7d8950), the plugin's copy of train_stage in loop_copy.py.
An engine whose type is not DistributedRLEngine (tunix's tests use spec'd MagicMocks, which pass
isinstance) keeps tunix's loop. This module also adds the upstream change's two seams,
`_stage_ahead_while_pending` and `_prestage_across_boundary`, as real methods a subclass can
override (removed exactly on uninstall). docs/tunix.md "The train loop, two ways" and "The two
seams a program subclass overrides".
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from tunix_stage_plugin.core import patching
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import probes

# The module of each way of the loop: only the way this tunix has is loaded.
WAYS = {probes.SEAM: "tunix_stage_plugin.hosts.tunix.loop_seam",
        probes.COPY: "tunix_stage_plugin.hosts.tunix.loop_copy"}

log = logging.getLogger("tunix_stage_plugin")


def _may_prestage(inst: installation_lib.Installation, program: Any) -> bool:
  """Cross-step prestage needs the next step's rollouts before the weight sync ends."""
  if program.max_staleness == 0:
    if inst.first_time("no-prestage-at-max-staleness-0"):
      log.info("tunix-stage: no cross-step prestage: max_staleness=0 holds the next step's "
               "rollouts until the weight sync ends; it needs max_staleness >= 1 (or None)")
    return False
  return True


def _stage_ahead_while_pending(self: Any, step: int, max_staged_batches: int) -> int:
  """How many of step `step`'s micro-batches to keep staged ahead while a train call is pending.

  Added by tunix-stage-plugin while staging is installed (the upstream change's name). Default:
  `max_staged_batches` (TUNIX_MAX_STAGED_BATCHES / --max_staged_batches). Asked once per step, when
  its staging starts (at the step's start, or at the previous boundary when it is prestaged). 0
  stages none of the step (it trains inline); more than the trainer's device bound is refused
  there and trained inline. Override in a subclass, e.g. a smaller depth while it evaluates.
  """
  del self, step
  return max_staged_batches


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation,
          program_cls: type, engine_cls: type) -> None:

  def _prestage_across_boundary(self: Any, next_step: int) -> bool:
    """Whether to stage step `next_step`'s first micro-batches while this step's boundary
    (update, weight sync) runs.

    Added by tunix-stage-plugin while staging is installed (the upstream change's name). Default:
    yes, unless `max_staleness=0` (the next step's rollouts then wait for the weight sync). Asked
    once per step boundary that has a next step. Override in a subclass, e.g. to skip the
    prestage at its own checkpoint boundaries.
    """
    del next_step
    return _may_prestage(inst, self)

  way = importlib.import_module(WAYS[probes.loop_way(program_cls)])
  way.apply(registry, inst, program_cls, engine_cls)
  registry.set(program_cls, "_stage_ahead_while_pending", _stage_ahead_while_pending)
  registry.set(program_cls, "_prestage_across_boundary", _prestage_across_boundary)
