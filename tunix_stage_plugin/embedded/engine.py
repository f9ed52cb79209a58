"""The orchestrator's engine for the embedded trainer: core.pipeline.StageEngine over gRPC."""

from __future__ import annotations

from typing import Any, Callable

from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.embedded import client as client_lib
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.embedded import data as data_lib
from tunix_stage_plugin.embedded import wire


class EmbeddedEngine:
  """stage / train / reset for core.pipeline.StagePipeline, plus the step boundary's calls."""

  def __init__(self, client: client_lib.WorkerClient, *,
               transfer_slowdown: Callable[[data_lib.Batch], float] | None = None) -> None:
    self.client = client
    # The benchmark's bursty scenario: a micro-batch's payload crosses the emulated wire this
    # many times slower, whichever call carries it.
    self._slowdown = transfer_slowdown or (lambda batch: 1.0)

  async def stage(self, payload: data_lib.Batch, *, key: str) -> outcome_lib.StageOutcome:
    try:
      answer = await self.client.call("stage_batch", payload, key=key,
                                      _pace=self._slowdown(payload))
    except wire.RemoteCallError as e:
      if e.error_type == store_lib.StageKeyError.__name__:  # a caller bug: fail loud, here too
        raise store_lib.StageKeyError(str(e)) from e
      raise
    return outcome_lib.StageOutcome.from_dict(answer)

  async def train(self, payload: data_lib.Batch | None, *, stage_key: str | None,
                  apply_optimizer: bool) -> outcome_lib.Trained:
    if stage_key is not None:
      result = await self.client.call("fwd_bwd", stage_key=stage_key)
    else:
      result = await self.client.call("fwd_bwd", payload, _pace=self._slowdown(payload))
    return outcome_lib.Trained(await self._maybe_update(result, apply_optimizer),
                               fallback=result["placement_fallback"])

  async def train_resident(self, mb_id: str, *, apply_optimizer: bool) -> outcome_lib.Trained:
    result = await self.client.call("fwd_bwd", resident=mb_id)
    return outcome_lib.Trained(await self._maybe_update(result, apply_optimizer))

  def resident(self) -> "ResidentEngine":
    return ResidentEngine(self)

  async def _maybe_update(self, result: dict[str, Any], apply_optimizer: bool) -> dict[str, Any]:
    if apply_optimizer:
      result = {**result, **await self.client.call("update")}
    return result

  async def reset(self, keys: list[str]) -> None:
    await self.client.call("reset_staged", keys)

  async def weight_sync(self, seconds: float) -> None:
    await self.client.call("weight_sync", seconds)


class ResidentEngine:
  """Trains micro-batches already resident on the trainer (the benchmark's ceiling); never stages."""

  def __init__(self, engine: EmbeddedEngine) -> None:
    self._engine = engine

  async def stage(self, payload: data_lib.Batch, *, key: str) -> outcome_lib.StageOutcome:
    raise NotImplementedError("resident micro-batches are never staged")

  async def train(self, payload: data_lib.Batch, *, stage_key: str | None,
                  apply_optimizer: bool) -> outcome_lib.Trained:
    return await self._engine.train_resident(payload.mb_id, apply_optimizer=apply_optimizer)

  async def reset(self, keys: list[str]) -> None:
    raise NotImplementedError("resident micro-batches are never staged")
