"""MaxTextTrainingEngine's placement: stage through the engine's own `_prepare_batch`, place the
traced half on exactly the engine's batch shardings, hand it back through that same seam.

The engine's fwd_bwd keeps everything after `_prepare_batch` (throttle, recompile, accumulate,
metrics). A staged batch goes stale when the adapter is set again (`with_gen_model_input_fn`);
it is then trained from its payload, as inline. `restore_checkpoint` and `close` drop every
staged batch first. Never compiles at stage time. Each step's figures go to the engine's own
metrics logger (metrics.py). docs/maxtext.md.
"""

from __future__ import annotations

import threading
import weakref
from types import ModuleType
from typing import Any

import jax
import numpy as np

from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.hosts import placements
from tunix_stage_plugin.hosts.maxtext import metrics

SEAM = "_prepare_batch"


class Staged:
  """What fwd_bwd is handed for a staged micro-batch; the engine's `_prepare_batch` resolves it."""

  __slots__ = ("payload", "dynamic", "static", "generation")

  def __init__(self, payload: Any, dynamic: Any, static: dict[str, Any], generation: int) -> None:
    self.payload = payload  # kept for an inline train when the placement went stale
    self.dynamic = dynamic  # the traced half, placed
    self.static = static  # the closed-over half, by reference
    self.generation = generation


def _place_leaf(leaf: Any, sharding: Any) -> Any:
  """device_put the leaves a compiled step would transfer; the rest pass as inline (MaxText's own
  rules for read-only inputs: arrays only, not rank-0 or empty, only fully addressable ones)."""
  if sharding is None or not isinstance(leaf, (jax.Array, np.ndarray)):
    return leaf
  if leaf.ndim == 0 or 0 in leaf.shape:
    return leaf
  if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
    return leaf
  return jax.device_put(leaf, sharding)


class MaxTextPlacement:

  name = "MaxText MaxTextTrainingEngine"
  host = "maxtext"
  seam = SEAM
  check = None  # the engine's _prepare_batch takes any payload; a failure there fails the stage

  def __init__(self, module: ModuleType) -> None:
    self.module = module
    self.engine_cls = module.MaxTextTrainingEngine
    self.original = self.engine_cls.__dict__[SEAM]
    self._lock = threading.Lock()
    # Bumped by with_gen_model_input_fn / restore_checkpoint: a batch staged before is stale.
    self._generations: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()

  def generation(self, engine: Any) -> int:
    with self._lock:
      return self._generations.get(engine, 0)

  def _bump(self, engine: Any) -> None:
    with self._lock:
      self._generations[engine] = self._generations.get(engine, 0) + 1

  def find(self, owner: Any) -> tuple[Any, str | None]:
    if not isinstance(owner, self.engine_cls):
      return None, None
    if getattr(type(owner), SEAM) is not self.engine_cls.__dict__[SEAM]:
      return None, (f"{type(owner).__qualname__} overrides {SEAM}; staging prepares through "
                    f"MaxTextTrainingEngine.{SEAM} once per micro-batch and cannot keep that "
                    "promise here")
    return owner, None

  def place(self, engine: Any, payload: Any) -> Staged:
    generation = self.generation(engine)
    dynamic, static = self.module._split_static_and_dynamic(self.original(engine, payload))  # pylint: disable=protected-access
    if engine._mesh is not None:  # pylint: disable=protected-access
      shardings = engine._batch_data_shardings(dynamic)  # pylint: disable=protected-access
      dynamic = jax.tree.map(_place_leaf, dynamic, shardings)
    # Finish the host-to-device copy here, on the staging thread, never in fwd_bwd.
    return Staged(payload, jax.block_until_ready(dynamic), static, generation)

  def _stale(self, engine: Any, staged: Staged) -> str | None:
    if staged.generation != self.generation(engine):
      return ("the engine's gen_model_input_fn was set, or a checkpoint restored, after this "
              "micro-batch was staged")
    if engine._mesh is None:  # pylint: disable=protected-access
      return None
    # The accumulators are donated at dispatch: check before it, there is no retry after.
    expected = engine._batch_data_shardings(staged.dynamic)  # pylint: disable=protected-access
    for leaf, sharding in zip(jax.tree.leaves(staged.dynamic), jax.tree.leaves(expected)):
      if isinstance(leaf, jax.Array) and leaf.committed and leaf.sharding != sharding:
        return f"a staged leaf is on {leaf.sharding}, the engine's batch sharding is {sharding}"
    return None

  def resolve(self, engine: Any, staged: Staged) -> tuple[Any, str | None]:
    """In the seam, consuming `staged`: the placed batch, or the payload prepared as inline (and
    why)."""
    stale = self._stale(engine, staged)
    if stale is not None:
      return self.original(engine, staged.payload), stale
    if isinstance(staged.dynamic, dict):
      return {**staged.dynamic, **staged.static}, None
    return staged.dynamic, None

  def computation(self, engine: Any, kind: str) -> Any:
    # What the engine's own throttler waits on: fwd_bwd's loss (also kept in _cached_losses),
    # the last computation update queued there (its gradient norm).
    if kind == tracks.FWD_BWD:
      return engine._cached_losses[-1]  # pylint: disable=protected-access
    return engine._throttler._inflight_queue.queue[-1][0]  # pylint: disable=protected-access

  def tracer(self, engine: Any) -> None:
    del engine  # MaxText's engine takes no tunix PerfTracer

  def metrics_logger(self, engine: Any) -> Any:
    return metrics.logger_of(self.module, engine)

  def step_sink(self, engine: Any, logger: Any) -> metrics.EngineSink:
    del engine
    return metrics.EngineSink(self.module, logger)

  def apply(self, registry: patching.PatchRegistry) -> None:
    cls = self.engine_cls
    original_set_fn = cls.__dict__["with_gen_model_input_fn"]
    original_restore = cls.__dict__["restore_checkpoint"]
    original_close = cls.__dict__["close"]

    def with_gen_model_input_fn(engine: Any, gen_model_input_fn: Any) -> Any:
      result = original_set_fn(engine, gen_model_input_fn)
      self._bump(engine)  # what was staged with the previous adapter trains from its payload
      return result

    def restore_checkpoint(engine: Any, **kwargs: Any) -> Any:
      # A staged micro-batch may already be folded into the restored accumulator.
      store_lib.discard(engine)
      self._bump(engine)
      return original_restore(engine, **kwargs)

    def close(engine: Any) -> None:
      store_lib.discard(engine)  # frees device memory before the engine's final save
      return original_close(engine)

    for name, fn in (("with_gen_model_input_fn", with_gen_model_input_fn),
                     ("restore_checkpoint", restore_checkpoint), ("close", close)):
      fn.__wrapped__ = cls.__dict__[name]
      fn.__doc__ = cls.__dict__[name].__doc__
      registry.set(cls, name, fn)
    placements.set_seam(registry, cls, SEAM)
    registry.on_undo(placements.register(self))
