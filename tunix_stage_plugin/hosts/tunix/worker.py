"""TrainerWorker: stage_batch / reset_staged, and fwd_bwd consuming a staged key exactly once.

A staged batch is prepared once: on the staging thread, through the trainer's own
`PeftTrainer._prepare_payload` (input preparation + sharding, inside the trainer's mesh), and at
consume time fwd_bwd hands that result to the trainer with its preparation seam passed through,
so a non-idempotent `_prepare_inputs` runs exactly once as inline. Why and how: docs/tunix.md.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import jax
from flax import nnx
from tunix.experimental.common import datatypes

from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.activation import registry as registry_lib
from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.hosts.tunix import transforms

STAGE_KEY = "stage_key"  # the fwd_bwd keyword that names a staged batch
SEAM = "_prepare_payload"  # PeftTrainer's preparation step, run once per micro-batch
# In a staged fwd_bwd's response metadata: why the staged batch was trained inline (None: it was
# trained from its placement).
PLACEMENT_FALLBACK = "placement_fallback"


class _Consuming(threading.local):
  """The staged batch a fwd_bwd on this thread is consuming (the seam passes it through)."""

  active = False
  payload: Any = None
  passed = False


_consuming = _Consuming()


class _WorkerStaging:
  """Per-worker staging state, kept outside the host object."""

  def __init__(self, max_device_batches: int) -> None:
    self.store = store_lib.StagedBatchStore(max_device_batches)
    self.mesh: jax.sharding.Mesh | None = None
    self.unsupported: str | None = None  # why this worker's trainer can never stage
    self.target: Any = None  # the PeftTrainer whose seam stages (the trainer, or behind a proxy)


_lock = threading.Lock()
_staging: "weakref.WeakKeyDictionary[Any, _WorkerStaging]" = weakref.WeakKeyDictionary()


def staging_of(worker: Any) -> _WorkerStaging:
  with _lock:
    state = _staging.get(worker)
    if state is None:
      bound = manager.current_config("tunix").max_device_batches
      state = _staging[worker] = _WorkerStaging(bound)
    return state


def _model_mesh(trainer: Any) -> jax.sharding.Mesh:
  for leaf in jax.tree.leaves(nnx.state(trainer.model)):
    if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, jax.sharding.NamedSharding):
      return leaf.sharding.mesh
  raise RuntimeError("the trainer's model parameters are not placed on a jax Mesh "
                     "(NamedSharding); staging places a payload on the trainer's mesh")


def _find_target(trainer: Any, peft_cls: type, seam: Any) -> tuple[Any, str | None]:
  """The PeftTrainer to stage through (the hosted trainer, or the one a mesh-binding proxy such as
  tunix's `_MeshBoundTrainer` forwards to), or None and why this trainer can never stage."""
  owner = getattr(getattr(trainer, SEAM, None), "__self__", None)
  if not isinstance(owner, peft_cls):
    return None, (f"the hosted trainer is a {type(trainer).__qualname__}, not a tunix PeftTrainer "
                  "(or a proxy forwarding to one); staging supports PeftTrainer")
  if getattr(type(owner), SEAM) is not seam:
    return None, (f"{type(owner).__qualname__} overrides {SEAM}; staging prepares through "
                  f"PeftTrainer.{SEAM} once per micro-batch and cannot keep that promise here")
  return owner, None


def _check_payload(payload: Any) -> None:
  if isinstance(payload, datatypes.TrainerPayload):
    raise TypeError(f"{type(payload).__name__} is not a JAX pytree; stage what the assembler "
                    "packs for fwd_bwd (e.g. rl_common.TrainExample or a dict of arrays)")


def _place(state: _WorkerStaging, payload: Any) -> Any:
  payload = transforms.apply_transforms(payload)
  if state.mesh is None:
    state.mesh = _model_mesh(state.target)
  # `with mesh:` (deprecated in JAX, and it warns) because the host's shard_input reads the
  # legacy thread-local mesh it sets; jax.set_mesh does not set that one.
  with state.mesh:
    placed = getattr(state.target, SEAM)(payload)
  # Finish the host-to-device copy here, on the staging thread, never in fwd_bwd.
  return jax.block_until_ready(placed)


def apply(registry: registry_lib.PatchRegistry, worker_cls: type, peft_cls: type) -> None:
  original_fwd_bwd = worker_cls.__dict__["fwd_bwd"]
  original_seam = peft_cls.__dict__[SEAM]

  @functools.wraps(original_seam)
  def prepare_payload(self: Any, payload: Any) -> Any:
    if _consuming.active:  # fwd_bwd(stage_key=...) on this thread: prepared at stage time
      _consuming.active = False
      if payload is not _consuming.payload:
        raise RuntimeError(f"the staged batch was replaced on its way from fwd_bwd to {SEAM}; "
                           "staging cannot keep its one-preparation promise with this trainer")
      _consuming.passed = True
      return payload
    return original_seam(self, payload)

  def stage_batch(self: Any, payload: Any, key: str) -> datatypes.Response:
    """Places `payload` on the trainer's mesh under `key` for a later fwd_bwd(stage_key=key)."""
    state = staging_of(self)
    if state.target is None and state.unsupported is None:
      state.target, state.unsupported = _find_target(
          self._trainer, peft_cls, peft_cls.__dict__[SEAM])  # pylint: disable=protected-access
    if state.unsupported is not None:
      store_lib.check_key(key)
      result = outcome_lib.unsupported(key, state.unsupported)
    else:
      result = state.store.stage(key, payload, functools.partial(_place, state),
                                 check=_check_payload)
    return self._response(staged=result.staged, outcome=result.as_dict())  # pylint: disable=protected-access

  def reset_staged(self: Any, keys: list[str] | None = None) -> datatypes.Response:
    """Drops staged batches (all when `keys` is None), freeing their device buffers."""
    dropped = staging_of(self).store.reset(keys)
    return self._response(dropped=dropped)  # pylint: disable=protected-access

  @functools.wraps(original_fwd_bwd)
  def fwd_bwd(self: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get(STAGE_KEY) is None:
      return original_fwd_bwd(self, *args, **kwargs)  # the host's call, untouched
    key = kwargs.pop(STAGE_KEY)
    payload = kwargs.pop("payload", args[0] if args else None)
    if payload is not None or len(args) > 1:
      raise ValueError(f"fwd_bwd got a payload and stage_key={key!r}; send one or the other")
    # take() removes the batch: a key is consumed exactly once; an unknown key raises.
    try:
      placed = staging_of(self).store.take(key)
    except store_lib.PlacementFailed as e:  # received, never placed: the host's own inline call
      response = original_fwd_bwd(self, e.payload, **kwargs)
      response.metadata[PLACEMENT_FALLBACK] = e.reason
      return response
    _consuming.active, _consuming.payload, _consuming.passed = True, placed, False
    try:
      response = original_fwd_bwd(self, placed, **kwargs)
      passed = _consuming.passed
    finally:
      _consuming.active, _consuming.payload = False, None
    if not passed:
      raise RuntimeError(f"fwd_bwd(stage_key={key!r}) did not reach {SEAM}; the staged batch "
                         "was prepared for a trainer that prepares there")
    response.metadata[PLACEMENT_FALLBACK] = None
    return response

  registry.set(peft_cls, SEAM, prepare_payload)
  registry.set(worker_cls, "stage_batch", stage_batch)
  registry.set(worker_cls, "reset_staged", reset_staged)
  registry.set(worker_cls, "fwd_bwd", fwd_bwd)
