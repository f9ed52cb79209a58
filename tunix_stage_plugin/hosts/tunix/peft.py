"""tunix's PeftTrainer's placement (hosts/placements.py): stage through its `_prepare_payload`.

A PeftTrainer subclass that overrides `_prepare_payload` is staged through its own override: the
first time such a trainer stages, the override becomes a seam too (through the installation's
patch registry, so uninstall restores it), so the override runs once per micro-batch, on the
staging thread. Which step is hooked, per trainer: docs/tunix.md, "What it hooks".
"""

from __future__ import annotations

import threading
import types
from typing import Any

import jax
from flax import nnx
from tunix.experimental.common import datatypes
from tunix.perf.experimental import tracer as tracer_lib

from tunix_stage_plugin.core import patching
from tunix_stage_plugin.hosts import placements
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import metrics

SEAM = "_prepare_payload"


def model_mesh(model: Any) -> jax.sharding.Mesh:
  for leaf in jax.tree.leaves(nnx.state(model)):
    if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, jax.sharding.NamedSharding):
      return leaf.sharding.mesh
  raise RuntimeError("the trainer's model parameters are not placed on a jax Mesh "
                     "(NamedSharding); staging places a payload on the trainer's mesh")


class PeftPlacement:
  """tunix's PeftTrainer and its subclasses: `_prepare_payload` (`_prepare_inputs`, then sharding
  on the mesh), or a subclass's own override of it."""

  name = "tunix PeftTrainer"
  host = "tunix"

  def __init__(self, peft_cls: type, registry: patching.PatchRegistry) -> None:
    self.peft_cls = peft_cls
    self._registry = registry  # where a subclass's override becomes a seam (undone on uninstall)
    self._lock = threading.Lock()  # stages of several workers may find the same class at once
    self._seams: set[type] = {peft_cls}  # the classes whose own _prepare_payload is a seam

  def find(self, trainer: Any) -> tuple[Any, str | None]:
    # The owner of the seam the trainer's fwd_bwd reaches.
    owner = placements.owner(trainer, SEAM, self.peft_cls)
    if owner is None:
      return None, None
    reason = self._seam_for(owner)
    return (None, reason) if reason is not None else (owner, None)

  def _seam_for(self, owner: Any) -> str | None:
    """Makes the `_prepare_payload` that `owner`'s fwd_bwd reaches a seam (None), or says why it
    cannot be one: then staging could not keep its one-preparation promise."""
    if SEAM in vars(owner):
      return (f"{type(owner).__qualname__} sets {SEAM} on the instance; staging hands a "
              f"staged batch through the class's {SEAM}, so it cannot keep its "
              "one-preparation promise here")
    cls = next(c for c in type(owner).__mro__ if SEAM in vars(c))
    with self._lock:
      if cls in self._seams:
        return None
      override = vars(cls)[SEAM]
      if not isinstance(override, types.FunctionType):
        return (f"{cls.__qualname__}.{SEAM} is a {type(override).__name__}, not a method "
                "defined in the class; staging prepares through the trainer's own method once "
                "per micro-batch and cannot keep that promise here")
      placements.set_seam(self._registry, self, cls, SEAM, f"{cls.__qualname__}.{SEAM}")
      self._seams.add(cls)
    return None

  def check(self, payload: Any) -> None:
    if isinstance(payload, datatypes.TrainerPayload):
      raise TypeError(f"{type(payload).__name__} is not a JAX pytree; stage what the assembler "
                      "packs for fwd_bwd (e.g. rl_common.TrainExample or a dict of arrays)")

  def place(self, target: Any, payload: Any) -> Any:
    mesh = model_mesh(target.model)
    # `with mesh:` (deprecated in JAX, and it warns) because the host's shard_input reads the
    # legacy thread-local mesh it sets; jax.set_mesh does not set that one.
    with mesh:
      placed = getattr(target, SEAM)(payload)
    # Finish the host-to-device copy here, on the staging thread, never in fwd_bwd.
    return jax.block_until_ready(placed)

  def resolve(self, target: Any, staged: Any) -> Any:
    """At consume time the seam returns the batch prepared at stage time, as it is."""
    del target
    return staged

  def computation(self, target: Any, kind: str) -> Any:
    # What PeftTrainer's own train() waits on for its perf span: the loss fwd_bwd just recorded
    # (_record_fwd_bwd), the gradient norm of the update (_record_update).
    if kind == contract.FWD_BWD:
      return target._buffered_train_metrics.losses[-1]  # pylint: disable=protected-access
    return target._last_update_grad_norm  # pylint: disable=protected-access

  def tracer(self, target: Any) -> tracer_lib.PerfTracer | None:
    """The PerfTracer a PeftTrainer was given, or None (no tracer: tunix's NoopTracer)."""
    tracer = target._perf_tracer_v2  # pylint: disable=protected-access
    return tracer if isinstance(tracer, tracer_lib.PerfTracer) else None

  def metrics_logger(self, target: Any) -> Any:
    return metrics.logger_of(target)

  def step_sink(self, target: Any, logger: Any) -> metrics.MetricsSink:
    return metrics.MetricsSink(logger, target.metrics_prefix)

  def apply(self) -> None:
    placements.set_seam(self._registry, self, self.peft_cls, SEAM, SEAM)
    self._registry.on_undo(placements.register(self))
