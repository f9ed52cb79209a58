"""The MaxText adapter object the `tunix_stage_plugin.hosts` entry point names."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tunix_stage_plugin.hosts import triggers
from tunix_stage_plugin.hosts import version
from tunix_stage_plugin.hosts.probing import Body, Probe, check, dotted, free, method

if TYPE_CHECKING:
  from tunix_stage_plugin.core import config as config_lib
  from tunix_stage_plugin.core import patching

DIST = "maxtext"
ENGINE = triggers.MAXTEXT_ENGINE
SEAM = "_prepare_batch"
WAIT = "self._throttler.wait_for_next"  # where fwd_bwd waits for the device


def _prepares_first(fwd_bwd: Any) -> str | None:
  """fwd_bwd's parsed code calls self._prepare_batch(payload) before it waits for the device
  (maxtext 0.2.5's order): a staged batch is handed through there, before any device work."""
  body = Body(fwd_bwd)
  prepares = any([dotted(a) for a in c.args] == ["payload"] for c in body.calls(f"self.{SEAM}"))
  order = body.call_order(f"self.{SEAM}", WAIT)
  if prepares and order == [f"self.{SEAM}", WAIT]:
    return None
  return (f"MaxTextTrainingEngine.fwd_bwd does not call self.{SEAM}(payload) before waiting "
          "for the device (maxtext 0.2.5's order)")


class MaxTextAdapter:
  name = "maxtext"
  trigger_modules = triggers.HOST_TRIGGERS["maxtext"]
  hook_groups = (
      "engine: a staged micro-batch prepared once through MaxTextTrainingEngine._prepare_batch, "
      "placed on the engine's batch shardings; stale after with_gen_model_input_fn, dropped on "
      "restore_checkpoint and close",
  )

  def __init__(self) -> None:
    self._module: ModuleType | None = None

  @property
  def module(self) -> ModuleType:
    if self._module is None:
      raise RuntimeError("maxtext adapter: call load() first")
    return self._module

  def load(self) -> None:
    self._module = importlib.import_module(ENGINE)

  def describe(self) -> str:
    return version.describe("maxtext", DIST, self._module.__file__ if self._module else None)

  def probe(self, config: config_lib.StageConfig) -> list[Probe]:
    del config  # no setting bears on what MaxText's hooks need
    m = self.module

    def engine_seam() -> str | None:
      engine = getattr(m, "MaxTextTrainingEngine", None)
      if engine is None:
        return f"{ENGINE} has no MaxTextTrainingEngine"
      return (method(engine, SEAM, params=("payload",), coroutine=False, own=True)
              or method(engine, "fwd_bwd", params=("payload",), coroutine=False, own=True)
              or _prepares_first(engine.fwd_bwd)
              or method(engine, "_batch_data_shardings", params=("dynamic_batch",),
                        coroutine=False)
              or free(engine))

    def split() -> str | None:
      missing = [f for f in ("_split_static_and_dynamic",) if not callable(getattr(m, f, None))]
      return f"{ENGINE} lacks {missing}" if missing else None

    def lifecycle() -> str | None:
      engine = m.MaxTextTrainingEngine
      return (method(engine, "with_gen_model_input_fn", params=("gen_model_input_fn",),
                     coroutine=False, own=True)
              or method(engine, "restore_checkpoint", params=(), coroutine=False, own=True)
              or method(engine, "close", params=(), coroutine=False, own=True))

    return [
        check(f"engine: MaxTextTrainingEngine.fwd_bwd prepares through {SEAM}(payload) first",
              engine_seam),
        check("engine: _split_static_and_dynamic(batch)", split),
        check("engine: with_gen_model_input_fn / restore_checkpoint / close", lifecycle),
    ]

  def apply(self, registry: patching.PatchRegistry, live: config_lib.LiveConfig) -> None:
    del live  # the bounds are the trainer worker's (the tunix adapter's installation)
    # pylint: disable-next=import-outside-toplevel  (imports JAX: only once maxtext is loaded)
    from tunix_stage_plugin.hosts.maxtext import placement
    placement.MaxTextPlacement(self.module).apply(registry)


ADAPTER = MaxTextAdapter()
