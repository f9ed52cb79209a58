"""TrainerWorker: stage_batch / reset_staged, and fwd_bwd consuming a staged key exactly once;
PeftTrainer's placement (its `_prepare_payload` seam).

A staged batch is prepared once, on the staging thread, through the hosted trainer's own
preparation step, and handed through that step at consume time (hosts/placements.py). Which
step depends on the trainer: docs/tunix.md, "What it hooks". A PeftTrainer subclass that
overrides `_prepare_payload` is staged through its own override: the first time such a trainer
stages, the override becomes a seam too (through the installation's patch registry, so
uninstall restores it), so the override runs once per micro-batch, on the staging thread. A
compressed payload (compression.py) is decoded first, on the same thread.
"""

from __future__ import annotations

import functools
import threading
import types
from typing import Any

import jax
from flax import nnx
from tunix.experimental.common import datatypes

from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core import keys as keys_lib
from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.hosts import placements
from tunix_stage_plugin.hosts.tunix import compression
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import transforms


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


def _place(state: installation_lib.WorkerStaging, payload: Any) -> Any:
  if isinstance(payload, compression.CompressedPayload):  # decoded here, on the staging lane
    payload = compression.decompress(payload)
  return state.placement.place(state.target, transforms.apply_transforms(payload))


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

  def stage_batch(self: Any, payload: Any, key: str) -> datatypes.Response:
    """Places `payload` under `key` for a later fwd_bwd(stage_key=key); answers a StageOutcome."""
    state = inst.staging_of(self)
    if state.placement is None and state.unsupported is None:
      state.placement, state.target, state.unsupported = placements.choose(self._trainer)  # pylint: disable=protected-access
      if state.target is not None:
        placements.track(state.target, state.store)
    if state.unsupported is not None:
      result = outcome_lib.unsupported(keys_lib.check(key), state.unsupported)
    else:
      state.sessions.admit(state.store, key)  # a new orchestrator: its predecessors' go
      # Two phases on the server's staging lane: answered once received, placed next there.
      result = state.store.stage(key, payload, functools.partial(_place, state),
                                 check=functools.partial(_check, state),
                                 defer=executor_lib.defer_on_current_lane())
    return self._response(**contract.stage_answer(result))  # pylint: disable=protected-access

  def reset_staged(self: Any, keys: list[str] | None = None) -> datatypes.Response:
    """Drops staged batches (all when `keys` is None), freeing their device buffers."""
    dropped = inst.staging_of(self).store.reset(keys)
    return self._response(**contract.reset_answer(dropped))  # pylint: disable=protected-access

  @functools.wraps(original_fwd_bwd)
  def fwd_bwd(self: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get(contract.STAGE_KEY) is None:
      return original_fwd_bwd(self, *args, **kwargs)  # the host's call, untouched
    key = kwargs.pop(contract.STAGE_KEY)
    payload = kwargs.pop("payload", args[0] if args else None)
    if payload is not None or len(args) > 1:
      raise ValueError(f"fwd_bwd got a payload and stage_key={key!r}; send one or the other")
    # take() removes the batch: a key is consumed exactly once; an unknown key raises.
    try:
      staged = inst.staging_of(self).store.take(key)
    except store_lib.PlacementFailed as e:  # received, never placed: the host's own inline call
      response = original_fwd_bwd(self, _unplaced_payload(key, e.payload), **kwargs)
      return contract.mark_placement_fallback(response, e.reason)
    with placements.Consume(staged) as consumed:
      response = original_fwd_bwd(self, staged, **kwargs)
    if not consumed.passed:
      raise RuntimeError(f"fwd_bwd(stage_key={key!r}) did not reach the trainer's preparation "
                         "step; the staged batch was prepared for a trainer that prepares there")
    return contract.mark_placement_fallback(response, consumed.fallback)

  PeftPlacement(peft_cls, registry).apply()
  registry.set(worker_cls, contract.STAGE_BATCH, stage_batch)
  registry.set(worker_cls, contract.RESET_STAGED, reset_staged)
  registry.set(worker_cls, contract.FWD_BWD, fwd_bwd)
