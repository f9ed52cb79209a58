"""Orchestrator-side stage pipeline: keep up to N micro-batches staged while a train call runs.

One step loop for every host (`run_steps`): each micro-batch trained exactly once and in order,
staged ahead (at most one stage call in flight, at most N staged or staging), the next step's
first ones prestaged during the boundary, every staged key released on every path out of a step.
The host has its say through two typed hooks only (`DepthFor`, `PrestageNext`); the pipeline keeps
the logic and the invariants either way. docs/design.md "Core semantics"; docs/tunix.md "The two
seams a program subclass overrides".
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib

log = logging.getLogger("tunix_stage_plugin")


@dataclasses.dataclass(frozen=True)
class MicroBatch:
  """One micro-batch; `closes_step` marks the step's last, the one that applies the optimizer."""

  payload: Any
  closes_step: bool = False


class StageEngine(Protocol):
  """What the pipeline drives (the tunix adapter and the embedded host both provide it)."""

  async def stage(self, payload: Any, *, key: str) -> contract.StageOutcome:
    """Stages `payload` under `key`. Raising counts as FAILED (the trainer may hold it), except
    for a StageKeyError: a malformed or reused key is the caller's bug and ends the step."""

  async def train(self, payload: Any, *, stage_key: str | None, apply_optimizer: bool
                  ) -> contract.Trained:
    """Trains one micro-batch: the staged one when `stage_key` is set, else `payload`.

    Raises outcome.StagedPayloadUnreadable when the staged payload did not decode on the trainer
    and nothing was trained; the pipeline then trains `payload` inline."""

  async def reset(self, keys: list[str]) -> None:
    """Drops staged keys that will not be consumed."""


class PipelineContractError(RuntimeError):
  """The source or caller broke the pipeline's contract (fail loud: training order is at stake)."""


DepthFor = Callable[[int, int], int]
"""`depth_for(step, depth)`: how many of `step`'s micro-batches to keep staged or staging ahead of
the pending train call (`depth` is the pipeline's own, TUNIX_MAX_STAGED_BATCHES; 0 stages none, the
step trains inline). Asked once per step, when its staging starts: at the step's start, or at the
previous step's boundary when the step is prestaged."""

PrestageNext = Callable[[int], bool]
"""`prestage_next(next_step)`: whether `next_step`'s first micro-batches start staging as soon as
this step's optimizer-applying call is sent (never one that closes its own step)."""


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


class Fallback(str):
  """Why a micro-batch trained inline instead of by key, as logs and the bench say it ("refused:
  device bound reached"), with its typed status: its stage's (refused, failed, unsupported), or
  UNPLACED. The telemetry counts fallbacks by `status`."""

  status: contract.StageStatus

  def __new__(cls, status: contract.StageStatus, reason: str | None) -> "Fallback":
    fallback = super().__new__(cls, f"{status.value}: {reason}")
    fallback.status = status
    return fallback


@dataclasses.dataclass
class StepReport:
  step: int
  trained: int = 0
  staged: int = 0  # dispatched by key
  inline: int = 0  # dispatched with the payload
  fallbacks: int = 0  # stages refused or failed, trained inline instead
  prestaged: int = 0  # staged during the previous step boundary and dispatched by key
  peak_staged: int = 0  # most micro-batches staged or staging at once
  fallback_reasons: list[Fallback] = dataclasses.field(default_factory=list)
  result: Any = None  # what the step's last train call returned (the optimizer-applying one)

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


async def settle(awaitable: Awaitable[Any]) -> Any:
  """Awaits `awaitable` to the end even if this task is cancelled meanwhile (cleanup must finish:
  an unfinished reset leaks a device slot); a cancel that arrived is re-raised afterwards."""
  task = asyncio.ensure_future(awaitable)
  cancelled = False
  while True:
    try:
      result = await asyncio.shield(task)
      break
    except asyncio.CancelledError:
      if task.done():
        raise
      cancelled = True
  if cancelled:
    raise asyncio.CancelledError
  return result


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
    self.depth = pipeline.depth_of(step)  # the step's stage-ahead depth (the host may set it)

  def staged_count(self) -> int:
    return sum(e.status in (_Status.STAGING, _Status.STAGED) for e in self.entries)

  def tasks(self) -> set[asyncio.Task]:
    return {t for t in (self.pull, self.stage and self.stage[1]) if t is not None}

  def advance(self) -> None:
    """Starts the next pull and the next stage when the window has room for them."""
    depth = self.depth
    if not self.exhausted and self.pull is None and len(self.entries) < max(depth, 1):
      self.pull = asyncio.create_task(_next_or_end(self.source))
    room = self.pipeline.room
    if room is not None:  # what a memory budget lets be staged now
      depth = min(depth, room() or depth)
    if (self.stage is None and self.pipeline.staging and self.pipeline.unsupported is None
        and self.staged_count() < depth):
      entry = next((e for e in self.entries if e.status is _Status.NEW), None)
      if entry is not None and (self.stage_closing or not entry.mb.closes_step):
        entry.status = _Status.STAGING
        self.stage = (entry, asyncio.create_task(self._stage(entry)))
        self.report.peak_staged = max(self.report.peak_staged, self.staged_count())

  async def _stage(self, entry: _Entry) -> contract.StageOutcome:
    recorder_lib.CALL.set((self.step, entry.index))  # this task's: what it sends counts here
    with self.pipeline.recorder.span(tracks.ORCHESTRATOR_STAGE,
                                     f"stage s{self.step} m{entry.index}", step=self.step,
                                     index=entry.index) as args:
      outcome = await self.pipeline.engine.stage(entry.mb.payload, key=entry.key)
      args["status"] = outcome.status.value if isinstance(outcome, contract.StageOutcome) \
          else None
      return outcome

  def handle(self, done: set[asyncio.Task]) -> None:
    if self.pull is not None and self.pull in done:
      task, self.pull = self.pull, None
      item = task.result()  # a failing source ends the step: raise
      if item is _END and self.pipeline.open_ended:
        self.exhausted = True  # the step ends after what it pulled (no optimizer-applying call)
      elif item is _END:
        raise PipelineContractError(
            f"the micro-batch source of step {self.step} ended after {self.pulled} micro-batch(es) "
            "without one marked closes_step=True")
      elif not isinstance(item, MicroBatch):
        raise PipelineContractError(
            f"the micro-batch source of step {self.step} yielded {type(item).__name__}; "
            "accepted: MicroBatch")
      else:
        key = contract.build_key(self.pipeline.key_prefix, self.step, self.pulled)
        self.entries.append(_Entry(self.pulled, item, key))
        self.pulled += 1
        self.exhausted = item.closes_step
    if self.stage is not None and self.stage[1] in done:
      (entry, task), self.stage = self.stage, None
      if task.cancelled():
        outcome = contract.failed(entry.key, "stage cancelled")
      elif task.exception() is not None:
        error = task.exception()
        if isinstance(error, contract.StageKeyError):
          raise error  # the caller's bug (a malformed or reused key), not a staging failure
        outcome = contract.failed(entry.key,
                                     f"stage call failed: {type(error).__name__}: {error}")
      else:
        outcome = task.result()
        if not isinstance(outcome, contract.StageOutcome) or outcome.key != entry.key:
          raise PipelineContractError(
              f"engine.stage returned {outcome!r} for key {entry.key!r}; accepted: a "
              "StageOutcome for that key")
      if outcome.staged:
        entry.status = _Status.STAGED
      else:
        self._fallback(entry, outcome)

  def _fallback(self, entry: _Entry, outcome: contract.StageOutcome) -> None:
    entry.status = _Status.FALLBACK
    self.report.fallbacks += 1
    self.report.fallback_reasons.append(Fallback(outcome.status, outcome.reason))
    log.info("stage of step %d micro-batch %d fell back to inline (%s): %s", self.step,
             entry.index, outcome.status.value, outcome.reason)
    if outcome.status is contract.StageStatus.FAILED:
      # The trainer may hold the batch although the call failed here (a lost reply): drop it so
      # it cannot hold a device slot. A refusal staged nothing.
      self.orphan_resets.append(asyncio.create_task(self.pipeline.reset_quietly([entry.key])))
    elif outcome.status is contract.StageStatus.UNSUPPORTED:
      self.pipeline.stop_staging(outcome.reason or "the trainer cannot stage")

  async def abort(self, extra_keys: tuple[str, ...] = ()) -> None:
    """After an error: stop pulling, settle the stage in flight, drop whatever is staged."""
    tasks = self.tasks()
    for task in tasks:
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    # A STAGING entry's key is included: its call may have reached the trainer before the cancel.
    keys = [*extra_keys, *(e.key for e in self.entries
                           if e.status in (_Status.STAGING, _Status.STAGED))]
    self.pull = self.stage = None
    self.entries.clear()
    # This reset runs beside the failed stages' own (other keys): against a trainer that does not
    # answer, the cleanup costs one reset's timeout, not one per reset.
    resets = [*self.orphan_resets, *([self.pipeline.reset_quietly(keys)] if keys else [])]
    await asyncio.gather(*resets, return_exceptions=True)


class Prestage:
  """The next step's first micro-batches, staging during the step boundary."""

  def __init__(self, window: _Window, driver: asyncio.Task) -> None:
    self._window = window
    self._driver = driver

  @property
  def source(self) -> AsyncIterator[MicroBatch]:
    return self._window.source

  async def adopt(self, step: int, source: AsyncIterator[MicroBatch]) -> _Window:
    if step != self._window.step or source is not self._window.source:
      raise PipelineContractError(
          f"prestage was made for step {self._window.step} and another source; it cannot be "
          f"adopted by step {step}")
    # Stop the driver; the pull and stage tasks it started are separate tasks and live on.
    self._driver.cancel()
    await asyncio.gather(self._driver, return_exceptions=True)
    if not self._driver.cancelled() and self._driver.exception() is not None:
      raise self._driver.exception()
    self._window.stage_closing = True
    for entry in self._window.entries:  # the stage calls that started during the boundary
      entry.prestaged = entry.status in (_Status.STAGING, _Status.STAGED)
    return self._window

  async def discard(self) -> None:
    """Drops the prestage (e.g. training ends): cancels it and resets what it staged."""
    self._driver.cancel()
    await asyncio.gather(self._driver, return_exceptions=True)
    await self._window.abort()


class StagePipeline:
  """Drives one engine; `depth` is TUNIX_MAX_STAGED_BATCHES. `staging=False` trains every
  micro-batch inline through the same loop (the unstaged baseline). `open_ended`: a step's source
  may end without a micro-batch that closes it (tunix's loop ends such a step without an update,
  e.g. when its scored queue answers no group); the step then ends after the micro-batches it
  pulled, its result the last train call's (None when it had none). Otherwise such a source
  breaks the contract (PipelineContractError). `room()`, where given, caps the micro-batches
  staged or staging at once below the step's depth as it goes (a memory budget's, which the
  first micro-batch sent may size; None: no cap)."""

  def __init__(self, engine: StageEngine, depth: int, *, key_prefix: str | None = None,
               recorder: recorder_lib.Recorder = recorder_lib.DISABLED, staging: bool = True,
               depth_for: DepthFor | None = None, open_ended: bool = False,
               room: Callable[[], int | None] | None = None) -> None:
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
      raise ValueError(f"depth (TUNIX_MAX_STAGED_BATCHES) must be an int >= 1; got {depth!r}")
    key_prefix = contract.run_prefix() if key_prefix is None else key_prefix
    contract.check_prefix(key_prefix)  # raises naming the rule
    self.engine = engine
    self.depth = depth
    self.key_prefix = key_prefix
    self.recorder = recorder  # its stage and train calls' spans (core.telemetry)
    self.staging = staging
    self.depth_for = depth_for
    self.open_ended = open_ended
    self.room = room
    self.unsupported: str | None = None  # why staging stopped for good (the trainer cannot stage)
    self.pending_resets: list[str] = []  # keys whose reset failed: retried before the next step

  def depth_of(self, step: int) -> int:
    """`step`'s stage-ahead depth: `depth`, or what the host's `depth_for` says for it."""
    if self.depth_for is None:
      return self.depth
    depth = self.depth_for(step, self.depth)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
      raise PipelineContractError(f"depth_for({step}, {self.depth}) returned {depth!r}; "
                                  "accepted: an int >= 0")
    return depth

  def may_prestage(self, next_step: int, steps: int | None,
                   prestage_next: PrestageNext | None) -> bool:
    """Whether `next_step` starts staging during this boundary: staging on (and supported), a
    next step to run (`steps` of them; None: no end), and the host agrees (asked only then)."""
    return (self.staging and self.unsupported is None and (steps is None or next_step < steps)
            and (prestage_next is None or _agreed(prestage_next, next_step)))

  def stop_staging(self, reason: str) -> None:
    """The trainer said it can never stage: every later micro-batch trains inline, no offer."""
    if self.unsupported is None:
      self.unsupported = reason
      log.warning("tunix-stage: the trainer cannot stage (%s); staging is off for this run and "
                  "every micro-batch trains inline", reason)

  async def reset_quietly(self, keys: list[str]) -> None:
    """Resets `keys`; a failed reset is kept and retried before the next step (never lost)."""
    try:
      await self.engine.reset(keys)
    except Exception as e:  # pylint: disable=broad-except  (cleanup must not mask the cause)
      self.pending_resets.extend(k for k in keys if k not in self.pending_resets)
      log.warning("could not reset staged keys %s (%s: %s); retrying before the next step", keys,
                  type(e).__name__, e)

  async def _retry_resets(self) -> None:
    if self.pending_resets:
      keys, self.pending_resets = self.pending_resets, []
      await self.reset_quietly(keys)

  def prestage(self, step: int, source: AsyncIterator[MicroBatch]) -> Prestage:
    """Starts staging `step`'s first micro-batches now; pass the result to `run_step`."""
    window = _Window(self, step, source, stage_closing=False)

    async def drive() -> None:
      if window.depth == 0:
        return  # the host stages none of this step ahead: nothing to pull during the boundary
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

  async def run_steps(
      self,
      source_for: Callable[[int], AsyncIterator[MicroBatch]],
      *,
      steps: int | None,
      prestage: bool = True,
      prestage_next: PrestageNext | None = None,
      before_step: Callable[[int], None] | None = None,
      after_step: Callable[[int, StepReport], Awaitable[None]] | None = None,
  ) -> int:
    """The step loop: steps 0, 1, ... (`steps` of them; None: until cancelled or a raise).

    `source_for(step)` gives a step's micro-batches (called once per step, when the step starts
    or when it is prestaged). When `prestage` is on and `prestage_next(next_step)` agrees (asked
    only where a prestage could start: staging on, a next step to run), the next step starts
    staging as soon as this step's optimizer-applying call is sent; the next step adopts it, and
    a prestage no step adopts (an error, the end) is discarded. The host's bookkeeping goes in
    `before_step` / `after_step`. Returns the number of steps run.
    """
    upcoming: Prestage | None = None
    step = 0
    try:
      while steps is None or step < steps:
        if before_step is not None:
          before_step(step)
        current, upcoming = upcoming, None
        source = current.source if current is not None else source_for(step)

        def after_final_dispatch(next_step: int = step + 1) -> None:
          nonlocal upcoming
          if prestage and self.may_prestage(next_step, steps, prestage_next):
            upcoming = self.prestage(next_step, source_for(next_step))

        report = await self.run_step(step, source, prestaged=current,
                                     after_final_dispatch=after_final_dispatch)
        if after_step is not None:
          await after_step(step, report)
        step += 1
    finally:
      if upcoming is not None:
        await settle(upcoming.discard())
    return step

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
    try:
      await self._retry_resets()
      window = (await prestaged.adopt(step, source) if prestaged is not None
                else _Window(self, step, source, stage_closing=True))
    except BaseException:
      if prestaged is not None:
        await settle(prestaged.discard())
      raise
    report = window.report
    pending: asyncio.Task | None = None
    pending_entry: _Entry | None = None
    closed = False
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
          result = pending.result()  # a failed train ends the step: never retried (exactly once)
          pending = None
          report.trained += 1
          report.result = result  # the step's result: its last train call's
          closed = pending_entry.mb.closes_step
        window.handle(done)
    except BaseException as e:
      # The train call in flight (or the one that just failed) may have been dispatched by key
      # and not reached the trainer's take(): reset its key too (a consumed key resets to nothing).
      extra: tuple[str, ...] = ()
      if pending is not None:
        # A train call already sent is let finish (it is not retried either way); only our own
        # cancellation cuts it short.
        if isinstance(e, asyncio.CancelledError):
          pending.cancel()
        await settle(asyncio.gather(pending, return_exceptions=True))
        if pending.cancelled() or pending.exception() is not None:
          extra = (pending_entry.key,) if pending_entry.status is _Status.STAGED else ()
      await settle(window.abort(extra))
      raise
    await settle(asyncio.gather(*window.orphan_resets))
    if not closed and not self.open_ended:
      raise PipelineContractError(f"step {step} ended without its optimizer-applying micro-batch")
    log.debug("step %d staging: %s", step, report.metrics())
    return report

  async def _train(self, window: _Window, entry: _Entry) -> Any:
    report = window.report
    staged = entry.status is _Status.STAGED
    recorder_lib.CALL.set((window.step, entry.index))  # this task's: what it sends counts here
    with self.recorder.span(tracks.ORCHESTRATOR_TRAIN, f"train s{window.step} m{entry.index}",
                            staged=staged, step=window.step, index=entry.index):
      try:
        trained = await self.engine.train(
            None if staged else entry.mb.payload,
            stage_key=entry.key if staged else None,
            apply_optimizer=entry.mb.closes_step,
        )
      except contract.StagedPayloadUnreadable as e:
        if not staged:
          raise
        # The trainer took the key and trained nothing: this micro-batch goes inline once.
        trained = _checked(await self.engine.train(entry.mb.payload, stage_key=None,
                                                   apply_optimizer=entry.mb.closes_step))
        trained = contract.Trained(trained.result, fallback=f"staged payload unreadable: {e}")
    _checked(trained)
    if staged and trained.fallback is not None:  # placed nothing: the trainer trained it inline
      staged = False
      report.fallbacks += 1
      report.fallback_reasons.append(Fallback(contract.StageStatus.UNPLACED,
                                              trained.fallback))
      log.info("staged micro-batch %d of step %d could not be placed; the trainer trained it "
               "inline: %s", entry.index, window.step, trained.fallback)
    if staged:
      report.staged += 1
      report.prestaged += entry.prestaged
    else:
      report.inline += 1
    return trained.result


def _agreed(prestage_next: PrestageNext, next_step: int) -> bool:
  answer = prestage_next(next_step)
  if not isinstance(answer, bool):
    raise PipelineContractError(f"prestage_next({next_step}) returned {answer!r}; accepted: a bool")
  return answer


def _checked(trained: Any) -> contract.Trained:
  if not isinstance(trained, contract.Trained):
    raise PipelineContractError(f"engine.train returned {type(trained).__name__}; accepted: "
                                "outcome.Trained")
  return trained
