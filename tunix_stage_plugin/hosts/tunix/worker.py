"""TrainerWorker: stage_batch / reset_staged, and fwd_bwd consuming a staged key exactly once;
PeftTrainer's placement (its `_prepare_payload` seam).

A staged batch is prepared once, on the staging thread, through the hosted trainer's own
preparation step, and handed through that step at consume time (hosts/placements.py). Which
step depends on the trainer: docs/tunix.md, "What it hooks". A PeftTrainer subclass that
overrides `_prepare_payload` is staged through its own override: the first time such a trainer
stages, the override becomes a seam too (through the installation's patch registry, so
uninstall restores it), so the override runs once per micro-batch, on the staging thread. A
compressed payload (compression.py) is decoded first, on the same thread.

Every fwd_bwd and update the worker runs is also observed for the job's telemetry, without
changing what it does or answers: its inline preparation timed through the same seam, its
computation's output handed to the installation's watcher (which records the device time off the
compute lane), and, where the trainer has a tunix PerfTracer, a `peft_train` span around it
(tracing.py). docs/observability.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import types
from typing import Any

import numpy as np

import jax
from flax import nnx
from tunix.experimental.common import datatypes

from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core import keys as keys_lib
from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.hosts import placements
from tunix_stage_plugin.hosts.tunix import compression
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import tracing
from tunix_stage_plugin.hosts.tunix import transforms

log = logging.getLogger("tunix_stage_plugin")


def model_mesh(model: Any) -> jax.sharding.Mesh:
  for leaf in jax.tree.leaves(nnx.state(model)):
    if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, jax.sharding.NamedSharding):
      return leaf.sharding.mesh
  raise RuntimeError("the trainer's model parameters are not placed on a jax Mesh "
                     "(NamedSharding); staging places a payload on the trainer's mesh")


def _hand_through(trainer: Any, staged: Any) -> Any:
  """At consume time the seam returns the batch prepared at stage time, as it is."""
  del trainer
  return staged


class PeftPlacement:
  """tunix's PeftTrainer and its subclasses: `_prepare_payload` (`_prepare_inputs`, then sharding
  on the mesh), or a subclass's own override of it."""

  name = "tunix PeftTrainer"
  host = "tunix"
  SEAM = "_prepare_payload"

  def __init__(self, peft_cls: type, registry: patching.PatchRegistry) -> None:
    self.peft_cls = peft_cls
    self._registry = registry  # where a subclass's override becomes a seam (undone on uninstall)
    self._lock = threading.Lock()  # stages of several workers may find the same class at once
    self._seams: set[type] = {peft_cls}  # the classes whose own _prepare_payload is a seam

  def find(self, trainer: Any) -> tuple[Any, str | None]:
    # The hosted trainer, or the PeftTrainer a mesh-binding proxy (tunix's _MeshBoundTrainer)
    # forwards to: the owner of the seam the trainer's fwd_bwd reaches.
    owner = getattr(getattr(trainer, self.SEAM, None), "__self__", None)
    if not isinstance(owner, self.peft_cls):
      return None, None
    reason = self._seam_for(owner)
    return (None, reason) if reason is not None else (owner, None)

  def _seam_for(self, owner: Any) -> str | None:
    """Makes the `_prepare_payload` that `owner`'s fwd_bwd reaches a seam (None), or says why it
    cannot be one: then staging could not keep its one-preparation promise."""
    if self.SEAM in vars(owner):
      return (f"{type(owner).__qualname__} sets {self.SEAM} on the instance; staging hands a "
              f"staged batch through the class's {self.SEAM}, so it cannot keep its "
              "one-preparation promise here")
    cls = next(c for c in type(owner).__mro__ if self.SEAM in vars(c))
    with self._lock:
      if cls in self._seams:
        return None
      override = vars(cls)[self.SEAM]
      if not isinstance(override, types.FunctionType):
        return (f"{cls.__qualname__}.{self.SEAM} is a {type(override).__name__}, not a method "
                "defined in the class; staging prepares through the trainer's own method once "
                "per micro-batch and cannot keep that promise here")
      self._registry.set(cls, self.SEAM, placements.seam(override, _hand_through,
                                                         f"{cls.__qualname__}.{self.SEAM}"))
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
      placed = getattr(target, self.SEAM)(payload)
    # Finish the host-to-device copy here, on the staging thread, never in fwd_bwd.
    return jax.block_until_ready(placed)

  def computation(self, target: Any, kind: str) -> Any:
    # What PeftTrainer's own train() waits on for its perf span: the loss fwd_bwd just recorded
    # (_record_fwd_bwd), the gradient norm of the update (_record_update).
    if kind == contract.FWD_BWD:
      return target._buffered_train_metrics.losses[-1]  # pylint: disable=protected-access
    return target._last_update_grad_norm  # pylint: disable=protected-access

  def tracer(self, target: Any) -> Any:
    return tracing.tracer_of(target)

  def apply(self) -> None:
    original = self.peft_cls.__dict__[self.SEAM]
    self._registry.set(self.peft_cls, self.SEAM,
                       placements.seam(original, _hand_through, self.SEAM))
    self._registry.on_undo(placements.register(self))


def _check(state: installation_lib.WorkerStaging, payload: Any) -> None:
  if isinstance(payload, compression.CompressedPayload):
    payload = compression.check(payload)  # refused at once when this trainer cannot decode it
  if state.placement.check is not None:
    state.placement.check(payload)


def _place(inst: installation_lib.Installation, state: installation_lib.WorkerStaging,
           payload: Any) -> Any:
  if isinstance(payload, compression.CompressedPayload):  # decoded here, on the staging lane
    payload = compression.decompress(payload)
  payload = transforms.apply_transforms(payload)
  with inst.recorder.span(tracks.TRAINER_H2D, "staged", lane="staging", bytes=_nbytes(payload)):
    return state.placement.place(state.target, payload)


def _nbytes(payload: Any) -> int:
  """The array bytes of a payload (a pytree)."""
  return sum(leaf.nbytes for leaf in jax.tree.leaves(payload)
             if isinstance(leaf, (np.ndarray, jax.Array)))


def _chosen(inst: installation_lib.Installation, worker: Any) -> installation_lib.WorkerStaging:
  """`worker`'s staging state, its trainer's placement chosen (on its first stage or call)."""
  state = inst.staging_of(worker)
  if state.placement is None and state.unsupported is None:
    state.placement, state.target, state.unsupported = placements.choose(worker._trainer)  # pylint: disable=protected-access
    if state.target is not None:
      placements.track(state.target, state.store)
  return state


def _unless_broken(inst: installation_lib.Installation, target: Any, read: Any) -> Any:
  """`read()` (what the telemetry reads of the trainer), or None, said once per trainer type,
  where this trainer does not hold it: its steps are then not measured, and it trains on."""
  try:
    return read()
  except Exception as e:  # pylint: disable=broad-except  (telemetry never fails a training call)
    if inst.first_time(f"unobserved:{type(target).__qualname__}"):
      log.warning("tunix-stage: telemetry: %s holds no computation output to watch (%s: %s); "
                  "its steps are not measured", type(target).__qualname__, type(e).__name__, e)
    return None


def _observed(inst: installation_lib.Installation, worker: Any, kind: str, call: Any,
              nbytes: int | None = None) -> Any:
  """`call()` (the worker's fwd_bwd or update), its computation handed to the watcher: queued
  once the call's inline preparation (if any) ended, its output watched off this lane."""
  state = _chosen(inst, worker)
  placement, target = state.placement, state.target
  if target is None:  # a trainer staging cannot serve: nothing to watch
    return call()
  tracer = _unless_broken(inst, target, lambda: placement.tracer(target))
  if tracer is not None:
    inst.trace_into(tracer, tracing.TracerSink)
  started = time.perf_counter()
  with contextlib.ExitStack() as stack:
    inline = stack.enter_context(placements.Inline(inst.recorder, nbytes))
    device_span = (None if tracer is None else stack.enter_context(
        tracing.computation(tracer, target, model_mesh(target.model))))
    result = call()
    output = _unless_broken(inst, target, lambda: placement.computation(target, kind))
  if output is not None:
    queued = started if inline.ended is None else max(started, inline.ended)
    inst.watcher(jax.block_until_ready, placement.host).dispatched(
        kind, queued, time.perf_counter(), output, on_ready=device_span)
  elif device_span is not None:  # no output to watch: its device span ends with the call
    device_span()
  return result


def _unplaced_payload(key: str, payload: Any) -> Any:
  """A received batch that was never placed, as the host's inline fwd_bwd takes it."""
  if not isinstance(payload, compression.CompressedPayload):
    return payload
  try:
    return compression.decompress(payload)
  except codec_lib.CodecError as e:  # trains nothing: the orchestrator sends it inline
    raise outcome_lib.StagedPayloadUnreadable(
        f"staged batch {key!r} did not decode ({e}); send it with its train call") from None


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation,
          worker_cls: type, peft_cls: type) -> None:
  original_fwd_bwd = worker_cls.__dict__["fwd_bwd"]
  original_update = worker_cls.__dict__["update"]

  def stage_batch(self: Any, payload: Any, key: str) -> datatypes.Response:
    """Places `payload` under `key` for a later fwd_bwd(stage_key=key); answers a StageOutcome."""
    state = _chosen(inst, self)
    if state.unsupported is not None:
      result = outcome_lib.unsupported(keys_lib.check(key), state.unsupported)
    else:
      state.sessions.admit(state.store, key)  # a new orchestrator: its predecessors' go
      # Two phases on the server's staging lane: answered once received, placed next there.
      result = state.store.stage(key, payload, functools.partial(_place, inst, state),
                                 check=functools.partial(_check, state),
                                 defer=executor_lib.defer_on_current_lane())
    return self._response(**contract.stage_answer(result))  # pylint: disable=protected-access

  def reset_staged(self: Any, keys: list[str] | None = None) -> datatypes.Response:
    """Drops staged batches (all when `keys` is None), freeing their device buffers."""
    dropped = inst.staging_of(self).store.reset(keys)
    return self._response(**contract.reset_answer(dropped))  # pylint: disable=protected-access

  @functools.wraps(original_fwd_bwd)
  def fwd_bwd(self: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get(contract.STAGE_KEY) is None:  # the host's call, observed only
      payload = kwargs.get("payload", args[0] if args else None)
      return _observed(inst, self, contract.FWD_BWD,
                       lambda: original_fwd_bwd(self, *args, **kwargs), _nbytes(payload))
    key = kwargs.pop(contract.STAGE_KEY)
    payload = kwargs.pop("payload", args[0] if args else None)
    if payload is not None or len(args) > 1:
      raise ValueError(f"fwd_bwd got a payload and stage_key={key!r}; send one or the other")
    # take() removes the batch: a key is consumed exactly once; an unknown key raises.
    try:
      staged = inst.staging_of(self).store.take(key)
    except store_lib.PlacementFailed as e:  # received, never placed: the host's own inline call
      unplaced = _unplaced_payload(key, e.payload)
      with inst.recorder.span(tracks.TRAINER_FALLBACK, key, reason=e.reason):
        response = _observed(inst, self, contract.FWD_BWD,
                             lambda: original_fwd_bwd(self, unplaced, **kwargs), _nbytes(unplaced))
      return contract.mark_placement_fallback(response, e.reason)
    with placements.Consume(staged) as consumed:
      response = _observed(inst, self, contract.FWD_BWD,
                           lambda: original_fwd_bwd(self, staged, **kwargs))
    if not consumed.passed:
      raise RuntimeError(f"fwd_bwd(stage_key={key!r}) did not reach the trainer's preparation "
                         "step; the staged batch was prepared for a trainer that prepares there")
    return contract.mark_placement_fallback(response, consumed.fallback)

  PeftPlacement(peft_cls, registry).apply()
  registry.set(worker_cls, contract.STAGE_BATCH, stage_batch)
  registry.set(worker_cls, contract.RESET_STAGED, reset_staged)
  registry.set(worker_cls, contract.FWD_BWD, fwd_bwd)

  @functools.wraps(original_update)
  def update(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The host's update, its computation observed (it ends a step of the telemetry)."""
    return _observed(inst, self, contract.UPDATE, lambda: original_update(self, *args, **kwargs))

  registry.set(worker_cls, contract.UPDATE, update)
