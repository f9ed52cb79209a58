"""The orchestrator's engine for the embedded trainer: core.pipeline.StageEngine over gRPC."""

from __future__ import annotations

import logging
from typing import Any

from tunix_stage_plugin.embedded import client as client_lib
from tunix_stage_plugin.embedded import data as data_lib

log = logging.getLogger("tunix_stage_plugin.embedded")


class StageFailedError(RuntimeError):
  """The trainer tried to place the micro-batch and failed (as opposed to refusing it)."""


class EmbeddedEngine:
  """stage / train / reset for core.pipeline.StagePipeline, plus the step boundary's calls."""

  def __init__(self, client: client_lib.WorkerClient) -> None:
    self.client = client

  async def stage(self, payload: data_lib.Batch, *, key: str) -> str | None:
    """The key when staged; None when refused (device bound, staging off); raises when it failed."""
    answer = await self.client.call("stage_batch", payload, key=key)
    if answer["staged"]:
      return key
    if answer["failed"]:
      raise StageFailedError(answer["reason"])
    log.info("stage of %s refused: %s", payload.mb_id, answer["reason"])
    return None

  async def train(self, payload: data_lib.Batch | None, *, stage_key: str | None,
                  apply_optimizer: bool) -> dict[str, Any]:
    if stage_key is not None:
      result = await self.client.call("fwd_bwd", stage_key=stage_key)
    else:
      result = await self.client.call("fwd_bwd", payload)
    return await self._maybe_update(result, apply_optimizer)

  async def train_resident(self, mb_id: str, *, apply_optimizer: bool) -> dict[str, Any]:
    result = await self.client.call("fwd_bwd", resident=mb_id)
    return await self._maybe_update(result, apply_optimizer)

  async def _maybe_update(self, result: dict[str, Any], apply_optimizer: bool) -> dict[str, Any]:
    if apply_optimizer:
      result = {**result, **await self.client.call("update")}
    return result

  async def reset(self, keys: list[str]) -> None:
    await self.client.call("reset_staged", keys)

  async def weight_sync(self, seconds: float) -> None:
    await self.client.call("weight_sync", seconds)
