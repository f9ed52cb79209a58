"""Orchestrator-side stage pipeline: keep up to N micro-batches staged while a train call runs.

For one step, micro-batches are pulled in order from an async source, staged on the trainer ahead
of their turn (at most one stage call in flight, at most N staged or staging), and trained in
order, each exactly once. While a train call is pending, the next pull and the stage call race it
(`asyncio.wait(FIRST_COMPLETED)`), so the next micro-batch is dispatched the moment the pending one
finishes. A refused or failed stage falls back to `train(payload)` and is counted.

`prestage` starts the next step's first micro-batches staging during the step boundary (update,
weight sync, checkpoint); `run_step(..., prestaged=...)` adopts them, including a stage or pull
still in flight. It never stages a micro-batch that closes its step.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import secrets
from typing import Any, AsyncIterator, Callable, Protocol

from tunix_stage_plugin.core import timeline as timeline_lib

log = logging.getLogger("tunix_stage_plugin")


@dataclasses.dataclass(frozen=True)
class MicroBatch:
  """One micro-batch; `closes_step` marks the step's last, the one that applies the optimizer."""

  payload: Any
  closes_step: bool = False


class StageEngine(Protocol):
  """What the pipeline drives (the tunix adapter and the embedded host both provide it)."""

  async def stage(self, payload: Any, *, key: str) -> str | None:
    """Stages `payload` under `key`; returns the key when staged, None when refused."""

  async def train(self, payload: Any, *, stage_key: str | None, apply_optimizer: bool) -> Any:
    """Trains one micro-batch: the staged one when `stage_key` is set, else `payload`."""

  async def reset(self, keys: list[str]) -> None:
    """Drops staged keys that will not be consumed."""


class PipelineContractError(RuntimeError):
  """The source or caller broke the pipeline's contract (fail loud: training order is at stake)."""


class _Status(enum.Enum):
  NEW = "new"  # pulled, not staged (yet)
  STAGING = "staging"
  STAGED = "staged"
  FALLBACK = "fallback"  # stage refused or failed: trains inline


@dataclasses.dataclass
class _Entry:
  index: int
  mb: MicroBatch
  key: str
  status: _Status = _Status.NEW
  prestaged: bool = False


@dataclasses.dataclass
class StepReport:
  step: int
  trained: int = 0
  staged: int = 0  # dispatched by key
  inline: int = 0  # dispatched with the payload
  fallbacks: int = 0  # stages refused or failed, trained inline instead
  prestaged: int = 0  # staged during the previous step boundary and dispatched by key
  peak_staged: int = 0  # most micro-batches staged or staging at once
  fallback_reasons: list[str] = dataclasses.field(default_factory=list)
  result: Any = None  # what the optimizer-applying train call returned

  def metrics(self) -> dict[str, int]:
    return {
        "stage/fallbacks": self.fallbacks,
        "stage/staged": self.staged,
        "stage/inline": self.inline,
        "stage/prestaged": self.prestaged,
        "stage/peak_staged": self.peak_staged,
    }


_END = object()


async def _next_or_end(source: AsyncIterator[MicroBatch]) -> Any:
  try:
    return await anext(source)
  except StopAsyncIteration:
    return _END


class _Window:
  """Micro-batches pulled ahead of dispatch, in order, with the pull and stage in flight."""

  def __init__(self, pipeline: "StagePipeline", step: int, source: AsyncIterator[MicroBatch],
               *, stage_closing: bool) -> None:
    self.pipeline = pipeline
    self.step = step
    self.source = source
    self.stage_closing = stage_closing
    self.entries: collections.deque[_Entry] = collections.deque()
    self.pull: asyncio.Task | None = None
    self.stage: tuple[_Entry, asyncio.Task] | None = None
    self.exhausted = False
    self.pulled = 0
    self.orphan_resets: list[asyncio.Task] = []
    self.report = StepReport(step)

  def staged_count(self) -> int:
    return sum(e.status in (_Status.STAGING, _Status.STAGED) for e in self.entries)

  def tasks(self) -> set[asyncio.Task]:
    return {t for t in (self.pull, self.stage and self.stage[1]) if t is not None}

  def advance(self) -> None:
    """Starts the next pull and the next stage when the window has room for them."""
    depth = self.pipeline.depth
    if not self.exhausted and self.pull is None and len(self.entries) < depth:
      self.pull = asyncio.create_task(_next_or_end(self.source))
    if self.stage is None and self.staged_count() < depth:
      entry = next((e for e in self.entries if e.status is _Status.NEW), None)
      if entry is not None and (self.stage_closing or not entry.mb.closes_step):
        entry.status = _Status.STAGING
        self.stage = (entry, asyncio.create_task(self._stage(entry)))
        self.report.peak_staged = max(self.report.peak_staged, self.staged_count())

  async def _stage(self, entry: _Entry) -> str | None:
    with self.pipeline.timeline.span("orchestrator/stage", f"stage s{self.step} m{entry.index}"):
      return await self.pipeline.engine.stage(entry.mb.payload, key=entry.key)

  def handle(self, done: set[asyncio.Task]) -> None:
    if self.pull is not None and self.pull in done:
      task, self.pull = self.pull, None
      item = task.result()  # a failing source ends the step: raise
      if item is _END:
        raise PipelineContractError(
            f"the micro-batch source of step {self.step} ended after {self.pulled} micro-batch(es) "
            "without one marked closes_step=True")
      if not isinstance(item, MicroBatch):
        raise PipelineContractError(
            f"the micro-batch source of step {self.step} yielded {type(item).__name__}; "
            "accepted: MicroBatch")
      key = f"{self.pipeline.key_prefix}-s{self.step}-m{self.pulled}"
      self.entries.append(_Entry(self.pulled, item, key))
      self.pulled += 1
      self.exhausted = item.closes_step
    if self.stage is not None and self.stage[1] in done:
      (entry, task), self.stage = self.stage, None
      if task.cancelled():
        self._fallback(entry, "stage cancelled")
        return
      error = task.exception()
      if error is not None:
        self._fallback(entry, f"stage failed: {type(error).__name__}: {error}")
      elif task.result() is None:
        self._fallback(entry, "stage refused by the trainer")
      elif task.result() != entry.key:
        raise PipelineContractError(
            f"engine.stage returned {task.result()!r} for key {entry.key!r}; accepted: the key or None")
      else:
        entry.status = _Status.STAGED

  def _fallback(self, entry: _Entry, reason: str) -> None:
    entry.status = _Status.FALLBACK
    self.report.fallbacks += 1
    self.report.fallback_reasons.append(reason)
    log.info("stage of step %d micro-batch %d fell back to inline: %s", self.step, entry.index,
             reason)
    # The trainer may hold the batch even though the call failed here (a lost reply): drop it so
    # it cannot hold a device slot. Refusals staged nothing, so they need no reset.
    if not reason.startswith("stage refused"):
      self.orphan_resets.append(asyncio.create_task(self.pipeline.reset_quietly([entry.key])))

  async def abort(self) -> None:
    """After an error: stop pulling, settle the stage in flight, drop whatever is staged."""
    tasks = self.tasks()
    for task in tasks:
      task.cancel()
    await asyncio.gather(*tasks, *self.orphan_resets, return_exceptions=True)
    # A STAGING entry's key is included: its call may have reached the trainer before the cancel.
    keys = [e.key for e in self.entries if e.status in (_Status.STAGING, _Status.STAGED)]
    self.pull = self.stage = None
    if keys:
      await self.pipeline.reset_quietly(keys)


class Prestage:
  """The next step's first micro-batches, staging during the step boundary."""

  def __init__(self, window: _Window, driver: asyncio.Task) -> None:
    self._window = window
    self._driver = driver

  @property
  def step(self) -> int:
    return self._window.step

  async def adopt(self, step: int, source: AsyncIterator[MicroBatch]) -> _Window:
    if step != self._window.step or source is not self._window.source:
      raise PipelineContractError(
          f"prestage was made for step {self._window.step} and another source; it cannot be "
          f"adopted by step {step}")
    # Stop the driver; the pull and stage tasks it started are separate tasks and live on.
    self._driver.cancel()
    await asyncio.gather(self._driver, return_exceptions=True)
    if not self._driver.cancelled() and self._driver.exception() is not None:
      await self._window.abort()
      raise self._driver.exception()
    self._window.stage_closing = True
    for entry in self._window.entries:
      entry.prestaged = True
    return self._window

  async def discard(self) -> None:
    """Drops the prestage (e.g. training ends): cancels it and resets what it staged."""
    self._driver.cancel()
    await asyncio.gather(self._driver, return_exceptions=True)
    await self._window.abort()


class StagePipeline:
  """Drives one engine; `depth` is TUNIX_MAX_STAGED_BATCHES."""

  def __init__(self, engine: StageEngine, depth: int, *, key_prefix: str | None = None,
               timeline: timeline_lib.Timeline | None = None) -> None:
    if not isinstance(depth, int) or depth < 1:
      raise ValueError(f"depth (TUNIX_MAX_STAGED_BATCHES) must be an int >= 1; got {depth!r}")
    self.engine = engine
    self.depth = depth
    # A per-pipeline prefix keeps keys unique across orchestrator restarts on one trainer.
    self.key_prefix = key_prefix or f"st{secrets.token_hex(4)}"
    self.timeline = timeline or timeline_lib.Timeline(enabled=False)

  async def reset_quietly(self, keys: list[str]) -> None:
    try:
      await self.engine.reset(keys)
    except Exception as e:  # pylint: disable=broad-except  (cleanup must not mask the cause)
      log.warning("could not reset staged keys %s: %s: %s", keys, type(e).__name__, e)

  def prestage(self, step: int, source: AsyncIterator[MicroBatch]) -> Prestage:
    """Starts staging `step`'s first micro-batches now; pass the result to `run_step`."""
    window = _Window(self, step, source, stage_closing=False)

    async def drive() -> None:
      while True:
        window.advance()
        tasks = window.tasks()
        if not tasks:
          if window.entries and window.entries[-1].mb.closes_step and \
              window.entries[-1].status is _Status.NEW:
            log.info("prestage of step %d stops before micro-batch %d: it closes its step", step,
                     window.entries[-1].index)
          return
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        window.handle(done)

    return Prestage(window, asyncio.create_task(drive()))

  async def run_step(
      self,
      step: int,
      source: AsyncIterator[MicroBatch],
      *,
      prestaged: Prestage | None = None,
      after_final_dispatch: Callable[[], None] | None = None,
  ) -> StepReport:
    """Trains every micro-batch of `source` once, in order; the last applies the optimizer.

    `after_final_dispatch` is called as soon as the optimizer-applying call is sent, so the caller
    can start the next step's `prestage` while the update runs.
    """
    window = (await prestaged.adopt(step, source) if prestaged is not None
              else _Window(self, step, source, stage_closing=True))
    report = window.report
    pending: asyncio.Task | None = None
    pending_entry: _Entry | None = None
    try:
      while True:
        if pending is None and window.entries and window.entries[0].status is not _Status.STAGING:
          pending_entry = window.entries.popleft()
          pending = asyncio.create_task(self._train(window, pending_entry))
          if pending_entry.mb.closes_step and after_final_dispatch is not None:
            after_final_dispatch()
        window.advance()
        tasks = window.tasks() | ({pending} if pending is not None else set())
        if not tasks:
          break
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if pending is not None and pending in done:
          task, pending = pending, None
          result = task.result()  # a failed train ends the step: never retried (exactly once)
          report.trained += 1
          if pending_entry.mb.closes_step:
            report.result = result
        window.handle(done)
    except BaseException as e:
      if pending is not None:
        # A train call already sent is let finish (it is not retried either way); only our own
        # cancellation cuts it short.
        if isinstance(e, asyncio.CancelledError):
          pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
      await window.abort()
      raise
    await asyncio.gather(*window.orphan_resets)
    if report.trained == 0 or not pending_entry.mb.closes_step:
      raise PipelineContractError(f"step {step} ended without its optimizer-applying micro-batch")
    log.debug("step %d staging: %s", step, report.metrics())
    return report

  async def _train(self, window: _Window, entry: _Entry) -> Any:
    report = window.report
    staged = entry.status is _Status.STAGED
    if staged:
      report.staged += 1
      report.prestaged += entry.prestaged
    else:
      report.inline += 1
    with self.timeline.span("orchestrator/train", f"train s{window.step} m{entry.index}",
                            staged=staged):
      return await self.engine.train(
          None if staged else entry.mb.payload,
          stage_key=entry.key if staged else None,
          apply_optimizer=entry.mb.closes_step,
      )
