"""A trainer's resources in virtual time, behind the core StageEngine protocol.

One wire (the orchestrator-trainer link), one host-to-device engine and one device, each used in
arrival order; the trainer's compute lane and staging lane; the store's device and host bounds.
A stage is received (its bytes cross the wire), answered once it holds a host buffer, and placed
next on the staging lane (it waits for a device slot, then copies); a train by key waits for its
placement and frees the slot; an inline train carries its bytes and copies on the compute lane.
The same semantics as the embedded trainer, with sleeps in the event loop's virtual time.
"""

from __future__ import annotations

import asyncio

from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.lab.bench import trace as bench_trace
from tunix_stage_plugin.lab.sim import trace as trace_lib

COMPUTE, SYNC = tracks.DEVICE_COMPUTE, tracks.DEVICE_SYNC
H2D, RECEIVE = tracks.TRAINER_H2D, tracks.TRAINER_RECEIVE
WIRE_CHUNKS = 4  # how finely concurrent transfers share the wire (the bench: 4 MiB of 16 MiB)


class _Resource:
  """Used in arrival order: a use starts when the previous one ended (or now). Split into
  `chunks`, two uses at once interleave chunk by chunk, sharing the resource (as a link's
  streams do)."""

  def __init__(self, chunks: int = 1) -> None:
    self._free_at = 0.0
    self._chunks = chunks

  async def use(self, seconds: float) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    first = None
    for _ in range(self._chunks):
      now = loop.time()
      start = max(now, self._free_at)
      first = start if first is None else first
      self._free_at = end = start + seconds / self._chunks
      await asyncio.sleep(end - now)
    return first, end


class SimMicroBatch:
  __slots__ = ("step", "index", "times", "update_s")

  def __init__(self, step: int, index: int, times: trace_lib.MicroBatchTimes,
               update_s: float) -> None:
    self.step, self.index, self.times, self.update_s = step, index, times, update_s

  @property
  def name(self) -> str:
    return f"s{self.step}-m{self.index}"


class SimTrainer:
  """core.pipeline.StageEngine in virtual time; records the spans bench.metrics reads."""

  def __init__(self, *, max_device_batches: int, max_host_batches: int, resident: bool = False,
               slot_wait_s: float = 30.0) -> None:
    self.resident = resident
    self.slot_wait_s = slot_wait_s
    self.timeline = bench_trace.Kept()
    # The wire is shared by concurrent calls (their streams interleave); copies queue whole.
    self._wire, self._h2d = _Resource(chunks=WIRE_CHUNKS), _Resource()
    self._compute, self._staging = asyncio.Lock(), asyncio.Lock()
    self._device = asyncio.Semaphore(max_device_batches)
    self._host = asyncio.Semaphore(max_host_batches)
    self._placed: dict[str, asyncio.Future] = {}
    self._lane_tasks: set[asyncio.Task] = set()

  def _now(self) -> float:
    return asyncio.get_running_loop().time()

  async def _receive(self, mb: SimMicroBatch) -> None:
    start, end = await self._wire.use(mb.times.wire_s)
    self.timeline.add(RECEIVE, mb.name, start, end, step=mb.step, transport="side", bytes=0)

  async def _copy(self, mb: SimMicroBatch, lane: str) -> None:
    start, end = await self._h2d.use(mb.times.h2d_s)
    self.timeline.add(H2D, mb.name, start, end, step=mb.step, lane=lane, bytes=0)

  async def stage(self, payload: SimMicroBatch, *, key: str) -> contract.StageOutcome:
    await self._receive(payload)
    answered = asyncio.get_running_loop().create_future()
    placed = self._placed[key] = asyncio.get_running_loop().create_future()

    async def lane() -> None:  # the stage_batch call, then its placement, next on the lane
      async with self._staging:
        try:
          await asyncio.wait_for(self._host.acquire(), self.slot_wait_s)
        except asyncio.TimeoutError:
          answered.set_result(contract.refused(key, "host bound reached"))
          return
        answered.set_result(contract.staged(key))
        await self._device.acquire()
        self._host.release()
        await self._copy(payload, "staging")
        placed.set_result(payload)

    task = asyncio.create_task(lane())
    self._lane_tasks.add(task)
    task.add_done_callback(self._lane_tasks.discard)
    return await answered

  async def train(self, payload: SimMicroBatch | None, *, stage_key: str | None,
                  apply_optimizer: bool) -> contract.Trained:
    if stage_key is None and not self.resident:
      await self._receive(payload)
    async with self._compute:
      if stage_key is not None:
        payload = await self._placed.pop(stage_key)
        self._device.release()  # take(): the slot frees as the batch is handed to compute
      elif not self.resident:
        await self._copy(payload, "inline")
      start = self._now()
      await asyncio.sleep(payload.times.compute_s)
      source = "resident" if self.resident else ("staged" if stage_key else "inline")
      self.timeline.add(COMPUTE, payload.name, start, self._now(), step=payload.step,
                        kind=tracks.FWD_BWD, source=source)
    if apply_optimizer:  # the update is its own call on the compute lane, right after
      async with self._compute:
        start = self._now()
        await asyncio.sleep(payload.update_s)
        self.timeline.add(COMPUTE, f"update s{payload.step}", start, self._now(),
                          step=payload.step, kind=tracks.UPDATE)
    return contract.Trained(payload.name)

  async def boundary(self, step: int, seconds: float) -> None:
    async with self._compute:
      start = self._now()
      await asyncio.sleep(seconds)
      self.timeline.add(SYNC, f"boundary after s{step}", start, self._now(), step=step)

  async def reset(self, keys: list[str]) -> None:
    for key in keys:
      future = self._placed.pop(key, None)
      if future is not None and future.done():
        self._device.release()
