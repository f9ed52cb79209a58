"""The MaxText adapter object the `tunix_stage_plugin.hosts` entry point names."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tunix_stage_plugin.hosts import triggers
from tunix_stage_plugin.hosts import version
from tunix_stage_plugin.hosts import probing
from tunix_stage_plugin.hosts.probing import Body, Probe, dotted, has_method, is_free, that

if TYPE_CHECKING:
  from tunix_stage_plugin.core import config as config_lib
  from tunix_stage_plugin.core import patching

DIST = "maxtext"
ENGINE = triggers.MAXTEXT_ENGINE
ENGINE_CLASS = "MaxTextTrainingEngine"
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


# One row per probe (hosts/probing.py `run`), on the engine module: its name, then what it checks,
# in order; the first check that does not hold gives the probe's refusal line.
PROBES: tuple[tuple[str, tuple[probing.Check, ...]], ...] = (
    (f"engine: MaxTextTrainingEngine.fwd_bwd prepares through {SEAM}(payload) first", (
        that(lambda m: getattr(m, ENGINE_CLASS, None) is not None,
             f"{ENGINE} has no MaxTextTrainingEngine"),
        has_method(ENGINE_CLASS, SEAM, params=("payload",), coroutine=False, own=True),
        has_method(ENGINE_CLASS, "fwd_bwd", params=("payload",), coroutine=False, own=True),
        lambda m: _prepares_first(m.MaxTextTrainingEngine.fwd_bwd),
        has_method(ENGINE_CLASS, "_batch_data_shardings", params=("dynamic_batch",),
                   coroutine=False),
        is_free(ENGINE_CLASS))),
    ("engine: _split_static_and_dynamic(batch)", (
        that(lambda m: callable(getattr(m, "_split_static_and_dynamic", None)),
             f"{ENGINE} lacks ['_split_static_and_dynamic']"),)),
    ("engine: with_gen_model_input_fn / restore_checkpoint / close", (
        has_method(ENGINE_CLASS, "with_gen_model_input_fn", params=("gen_model_input_fn",),
                   coroutine=False, own=True),
        has_method(ENGINE_CLASS, "restore_checkpoint", params=(), coroutine=False, own=True),
        has_method(ENGINE_CLASS, "close", params=(), coroutine=False, own=True))),
)


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
    return probing.run(PROBES, self.module)

  def apply(self, registry: patching.PatchRegistry, live: config_lib.LiveConfig) -> None:
    del live  # the bounds are the trainer worker's (the tunix adapter's installation)
    # pylint: disable-next=import-outside-toplevel  (imports JAX: only once maxtext is loaded)
    from tunix_stage_plugin.hosts.maxtext import placement
    placement.MaxTextPlacement(self.module).apply(registry)


ADAPTER = MaxTextAdapter()
