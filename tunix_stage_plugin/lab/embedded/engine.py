"""The orchestrator's engine for the embedded trainer: core.pipeline.StageEngine over gRPC. The
trainer's errors come back as contract.RemoteError and are typed by contract.typed_errors, the map
tunix's host uses (docs/embedded.md)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable

from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import data as data_lib

@dataclasses.dataclass
class WireStats:
  """Bytes of the micro-batches sent, as arrays (raw) and as they crossed the wire (sent)."""

  stages: int = 0
  stage_raw_bytes: int = 0
  stage_sent_bytes: int = 0
  inline: int = 0
  inline_bytes: int = 0
  encode_s: float = 0.0  # orchestrator seconds packing stage payloads (off the event loop)

  @property
  def ratio(self) -> float | None:
    return self.stage_raw_bytes / self.stage_sent_bytes if self.stage_sent_bytes else None

  def as_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "ratio": self.ratio}


class EmbeddedEngine:
  """stage / train / reset for core.pipeline.StagePipeline, plus the step boundary's calls.

  `codec` (core.codec.Codec, TUNIX_STAGE_CODEC): a stage's payload is packed on a worker thread
  (never on the event loop) and the trainer unpacks it on its staging lane; train calls that
  carry their micro-batch (inline) always send it as it is.
  """

  def __init__(self, client: client_lib.WorkerClient, *,
               transfer_slowdown: Callable[[data_lib.Batch], float] | None = None,
               codec: Any = None) -> None:
    self.client = client
    # The benchmark's bursty scenario: a micro-batch's payload crosses the emulated wire this
    # many times slower, whichever call carries it.
    self._slowdown = transfer_slowdown or (lambda batch: 1.0)
    self.codec = codec
    self.wire = WireStats()
    self.recorder: recorder_lib.Recorder = recorder_lib.DISABLED  # each payload's send (telemetry)
    self.auto: Any = None  # core.sizing.AutoDepth, told each stage's answer (a job at auto)

  async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
    """One call to the trainer; its error, when the plugin has a type for it, raised as that."""
    with contract.typed_errors(method):  # the one map of the trainer's errors (contract.py)
      return await self.client.call(method, *args, **kwargs)

  async def _send(self, method: str, nbytes: int, *args: Any, **kwargs: Any) -> Any:
    """One call carrying a micro-batch, its send recorded by the transport that carried it (the
    bulk channel, or one gRPC message for a small one)."""
    call = recorder_lib.CALL.get()
    with self.recorder.span(tracks.ORCHESTRATOR_SEND, method, transport=contract.UNARY,
                            bytes=nbytes, step=None if call is None else call[0]) as sent:
      return await self._call(method, *args, _carried=sent, **kwargs)

  def _pack(self, payload: data_lib.Batch) -> data_lib.PackedBatch:
    """Runs on a worker thread."""
    return data_lib.pack_batch(self.codec, payload)

  async def stage(self, payload: data_lib.Batch, *, key: str) -> contract.StageOutcome:
    sent: Any = payload
    sent_bytes = payload.nbytes
    if self.codec is not None:
      start = asyncio.get_running_loop().time()
      sent = await asyncio.to_thread(self._pack, payload)
      self.wire.encode_s += asyncio.get_running_loop().time() - start
      sent_bytes = sent.wire_bytes
    self.wire.stages += 1
    self.wire.stage_raw_bytes += payload.nbytes
    self.wire.stage_sent_bytes += sent_bytes
    answer = contract.StageOutcome.from_dict(await self._send(
        "stage_batch", sent_bytes, sent, key=key, _pace=self._slowdown(payload)))
    if self.auto is not None:  # the trainer's newest step on it, for the depth at auto
      self.auto.answered(answer)
    return answer

  async def train(self, payload: data_lib.Batch | None, *, stage_key: str | None,
                  apply_optimizer: bool) -> contract.Trained:
    if stage_key is not None:
      result = await self._call("fwd_bwd", stage_key=stage_key)
    else:
      result = await self._train_inline(payload)
    return contract.Trained(await self._maybe_update(result, apply_optimizer),
                               fallback=result["placement_fallback"])

  async def _train_inline(self, payload: data_lib.Batch) -> dict[str, Any]:
    self.wire.inline += 1
    self.wire.inline_bytes += payload.nbytes
    return await self._send("fwd_bwd", payload.nbytes, payload, _pace=self._slowdown(payload))

  async def train_resident(self, mb_id: str, *, apply_optimizer: bool) -> contract.Trained:
    result = await self._call("fwd_bwd", resident=mb_id)
    return contract.Trained(await self._maybe_update(result, apply_optimizer))

  def resident(self) -> "ResidentEngine":
    return ResidentEngine(self)

  async def _maybe_update(self, result: dict[str, Any], apply_optimizer: bool) -> dict[str, Any]:
    if apply_optimizer:
      result = {**result, **await self._call("update")}
    return result

  async def reset(self, keys: list[str]) -> None:
    await self._call("reset_staged", keys)

  async def weight_sync(self, seconds: float) -> None:
    await self._call("weight_sync", seconds)


class ResidentEngine:
  """Trains micro-batches already resident on the trainer (the benchmark's ceiling); never stages."""

  def __init__(self, engine: EmbeddedEngine) -> None:
    self._engine = engine

  async def stage(self, payload: data_lib.Batch, *, key: str) -> contract.StageOutcome:
    raise NotImplementedError("resident micro-batches are never staged")

  async def train(self, payload: data_lib.Batch, *, stage_key: str | None,
                  apply_optimizer: bool) -> contract.Trained:
    return await self._engine.train_resident(payload.mb_id, apply_optimizer=apply_optimizer)

  async def reset(self, keys: list[str]) -> None:
    raise NotImplementedError("resident micro-batches are never staged")
