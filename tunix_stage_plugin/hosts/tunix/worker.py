"""TrainerWorker: stage_batch / reset_staged, and fwd_bwd consuming a staged key exactly once.

stage_batch runs on the server's staging thread (see server.py). It applies the registered payload
transforms, then places the payload through the trainer's own preparation path
(`_prepare_payload`: input preparation + sharding) inside `with mesh:`, because the mesh context
that path reads is thread-local and the staging thread has none of its own. The mesh is the one
the trainer's model parameters live on. stage_batch never calls the readiness check and never
writes the worker state: during a cross-step prestage the worker is legitimately SYNCING, and the
state setter has no lock. Whatever goes wrong in staging is answered as staged=False with a
reason, so the orchestrator trains that micro-batch inline; the worker stays as it was.
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
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.hosts.tunix import transforms

STAGE_KEY = "stage_key"  # the fwd_bwd keyword that names a staged batch


class _WorkerStaging:
  """Per-worker staging state, kept outside the host object."""

  def __init__(self, max_device_batches: int) -> None:
    self.store = store_lib.StagedBatchStore(max_device_batches)
    self.mesh: jax.sharding.Mesh | None = None


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


def _place(worker: Any, state: _WorkerStaging, payload: Any) -> Any:
  payload = transforms.apply_transforms(payload)
  if isinstance(payload, datatypes.TrainerPayload):
    raise TypeError(f"{type(payload).__name__} is not a JAX pytree; stage what the assembler "
                    "packs for fwd_bwd (e.g. rl_common.TrainExample or a dict of arrays)")
  trainer = worker._trainer  # pylint: disable=protected-access
  if state.mesh is None:
    state.mesh = _model_mesh(trainer)
  # `with mesh:` (deprecated in JAX, and it warns) because the host's shard_input reads the
  # legacy thread-local mesh it sets; jax.set_mesh does not set that one.
  with state.mesh:
    placed = trainer._prepare_payload(payload)  # pylint: disable=protected-access
  # Finish the host-to-device copy here, on the staging thread, never in fwd_bwd.
  return jax.block_until_ready(placed)


def apply(registry: registry_lib.PatchRegistry, worker_cls: type) -> None:
  original_fwd_bwd = worker_cls.__dict__["fwd_bwd"]

  def stage_batch(self: Any, payload: Any, key: str) -> datatypes.Response:
    """Places `payload` on the trainer's mesh under `key` for a later fwd_bwd(stage_key=key)."""
    state = staging_of(self)
    result = state.store.stage(key, payload, functools.partial(_place, self, state))
    return self._response(staged=result.staged, stage_key=key, reason=result.reason)  # pylint: disable=protected-access

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
    return original_fwd_bwd(self, staging_of(self).store.take(key), **kwargs)

  registry.set(worker_cls, "stage_batch", stage_batch)
  registry.set(worker_cls, "reset_staged", reset_staged)
  registry.set(worker_cls, "fwd_bwd", fwd_bwd)
