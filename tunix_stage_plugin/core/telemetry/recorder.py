"""The spans one process records of its staging path, and the steps they make.

A span is (track, name, start, end, args) in `time.perf_counter` seconds, recorded where the work
happens by code that knows nothing of who listens. With no sink a span costs one branch; a sink
that raises is dropped with one line: telemetry never fails a job. `TrainerSteps` closes a step
with its update's computation (seen ready by the `ComputeWatcher` thread); `OrchestratorSteps`
makes a step's figures from the pipeline's report. docs/observability.md "How it is measured".
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import logging
import queue
import statistics
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Protocol

from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import figures as figures_lib

log = logging.getLogger("tunix_stage_plugin")


@dataclasses.dataclass(frozen=True)
class Span:
  track: str  # core.tracks
  name: str
  start: float
  end: float
  args: tuple[tuple[str, Any], ...] = ()

  @property
  def duration(self) -> float:
    return self.end - self.start


class Sink(Protocol):
  """Told of each finished span (on the thread that recorded it; keep it short)."""

  def record(self, span: Span) -> None:
    ...


class Recorder:
  """Thread-safe fan-out of spans (`add`: after the fact; `span`: live, timed here)."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._sinks: tuple[Sink, ...] = ()

  @property
  def enabled(self) -> bool:
    return bool(self._sinks)

  def add_sink(self, sink: Sink) -> None:
    with self._lock:
      self._sinks = (*self._sinks, sink)

  def remove_sink(self, sink: Sink) -> None:
    with self._lock:
      self._sinks = tuple(s for s in self._sinks if s is not sink)

  def add(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
    sinks = self._sinks
    if not sinks:
      return
    span = Span(track, name, start, end, tuple(sorted(args.items())))
    for sink in sinks:
      try:
        sink.record(span)
      except Exception as e:  # pylint: disable=broad-except  (see the module docstring)
        self._drop(sink, e)

  @contextlib.contextmanager
  def span(self, track: str, name: str, **args: Any) -> Iterator[dict[str, Any]]:
    """Times the block; yields its args (the block may add to them, e.g. the bytes it read)."""
    if not self._sinks:
      yield args
      return
    start = time.perf_counter()
    try:
      yield args
    finally:
      self.add(track, name, start, time.perf_counter(), **args)

  def _drop(self, sink: Sink, error: Exception) -> None:
    self.remove_sink(sink)
    say_dropped(sink, error)


def say_dropped(sink: Any, error: Exception) -> None:
  """The one line said when a sink (of spans, or of a step's figures) raised and was dropped."""
  log.warning("tunix-stage: telemetry: %s failed (%s: %s) and was dropped; staging goes on",
              type(sink).__name__, type(error).__name__, error)


class _Disabled(Recorder):
  """A recorder that never takes a sink: the shared default of code given none."""

  def add_sink(self, sink: Sink) -> None:
    raise RuntimeError("this recorder is disabled; make a Recorder() to record")


DISABLED = _Disabled()

# The pipeline's call in progress on this task: (step, micro-batch index), so that what a call
# sends on the way down (a route recording its transport) is counted in its step.
CALL: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "tunix_stage_call", default=None)


def busy_time(spans: Iterable[Span], start: float, end: float) -> float:
  """Seconds of [start, end] covered by at least one span (overlaps counted once)."""
  intervals = sorted((max(s.start, start), min(s.end, end)) for s in spans)
  total, cursor = 0.0, start
  for lo, hi in intervals:
    lo = max(lo, cursor)
    if hi > lo:
      total += hi - lo
      cursor = hi
  return total


def idle_time(spans: Iterable[Span], start: float, end: float) -> float:
  """Seconds of [start, end] that no span covers: the device waiting for work."""
  return max(0.0, (end - start) - busy_time(spans, start, end))


# ---------------------------------------------------------------- the trainer's steps

ALONE_WINDOW = 64  # the recent fwd_bwd computations that ran alone, the slowdown's baseline
WATCH_CLOSE_S = 10.0


@dataclasses.dataclass
class _Dispatched:
  kind: str
  queued: float  # when it could start: the call's start, or the end of its inline placement
  answered: float  # when the call returned
  output: Any  # an output of the computation: ready when it has ended
  args: dict[str, Any]
  on_ready: Callable[[], None] | None  # told once the output is ready (a tracer's device span)


class ComputeWatcher:
  """Records each dispatched computation's device span (tracks.DEVICE_COMPUTE) once `wait(output)`
  returns, on a daemon thread of its own; in dispatch order (one device, one queue). The one wait
  for a computation: whatever else needs its end (tunix's PerfTracer) is told by `on_ready`."""

  def __init__(self, rec: Recorder, wait: Callable[[Any], None]) -> None:
    self._recorder = rec
    self._wait = wait
    self._queue: queue.SimpleQueue[_Dispatched | threading.Event | None] = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._thread: threading.Thread | None = None
    self._last_end = 0.0

  def dispatched(self, kind: str, queued: float, answered: float, output: Any, *,
                 on_ready: Callable[[], None] | None = None, **args: Any) -> None:
    with self._lock:
      if self._thread is None:
        self._thread = threading.Thread(target=self._watch, name="tunix-stage-compute-watch",
                                        daemon=True)
        self._thread.start()
    self._queue.put(_Dispatched(kind, queued, answered, output, args, on_ready))

  def drain(self, timeout: float | None = None) -> bool:
    """Waits until every computation dispatched so far is recorded."""
    with self._lock:
      if self._thread is None:
        return True
    done = threading.Event()
    self._queue.put(done)
    return done.wait(timeout)

  def close(self, timeout: float = WATCH_CLOSE_S) -> None:
    with self._lock:
      thread, self._thread = self._thread, None
    if thread is not None:
      self._queue.put(None)
      thread.join(timeout)

  def _watch(self) -> None:
    while True:
      item = self._queue.get()
      if item is None:
        return
      if isinstance(item, threading.Event):
        item.set()
        continue
      try:
        self._wait(item.output)
      except Exception as e:  # pylint: disable=broad-except  (a failed computation: no span)
        log.debug("tunix-stage: a %s computation failed (%s): not recorded", item.kind, e)
        continue
      finally:
        item.output = None  # its buffers are the device's again
      end = time.perf_counter()
      start = min(max(item.queued, self._last_end), end)
      self._last_end = end
      self._recorder.add(tracks.DEVICE_COMPUTE, item.kind, start, end, kind=item.kind,
                         answered=item.answered, **item.args)
      if item.on_ready is not None:
        try:
          item.on_ready()
        except Exception as e:  # pylint: disable=broad-except  (telemetry never fails a job)
          log.warning("tunix-stage: telemetry: telling the end of a %s computation failed "
                      "(%s: %s)", item.kind, type(e).__name__, e)


# What a trainer's step is made of.
TRACKS = frozenset({tracks.DEVICE_COMPUTE, tracks.DEVICE_SYNC, tracks.TRAINER_LANE,
                    tracks.TRAINER_RECEIVE, tracks.TRAINER_H2D, tracks.TRAINER_POOL_WAIT})

Peaks = Callable[[], tuple[int, int]]
"""The most staged micro-batches held at once since the last call, (device, host); resets."""


class TrainerSteps:
  """A Sink: one trainer's spans in, `on_step(figures)` out once per step (on the thread that
  recorded the step's update computation)."""

  def __init__(self, on_step: Callable[[dict[str, Any]], None],
               peaks: Peaks | None = None, alone: Iterable[float] = ()) -> None:
    """`alone`: fwd_bwd durations that ran without a transfer beside them, to start the
    slowdown's baseline with (the same process's computations before a restart)."""
    self._on_step = on_step
    self.peaks = peaks
    self._lock = threading.Lock()
    self._spans: dict[str, list[Span]] = collections.defaultdict(list)
    self._alone: collections.deque[float] = collections.deque(alone, maxlen=ALONE_WINDOW)
    self._step = 0
    self._last_end: float | None = None

  def alone(self) -> list[float]:
    """The slowdown's baseline: the recent fwd_bwd durations that ran alone."""
    with self._lock:
      return list(self._alone)

  def record(self, span: Span) -> None:
    if span.track not in TRACKS:  # another side's (an orchestrator in the same process)
      return
    with self._lock:
      self._spans[span.track].append(span)
      if span.track != tracks.DEVICE_COMPUTE or dict(span.args).get("kind") != tracks.UPDATE:
        return
      figures = self._close(span)
    self._on_step(figures)

  def _close(self, update: Span) -> dict[str, Any]:
    spans, self._spans = self._spans, collections.defaultdict(list)
    computations = sorted(spans[tracks.DEVICE_COMPUTE], key=lambda s: s.start)
    # The compute lane's own calls: the weight sync (the embedded host's DEVICE_SYNC), ...
    lanes = [*spans[tracks.TRAINER_LANE], *spans[tracks.DEVICE_SYNC]]
    first, end = computations[0].start, update.end
    prev_end, self._last_end = self._last_end, end
    busy = busy_time(computations, first, end)
    # The device idle mid-step while the compute lane ran no call of its own (e.g. an eval).
    mid_wait = idle_time([*computations, *lanes], first, end)
    boundary = None if prev_end is None else idle_time(
        lanes, prev_end, max(prev_end, first))
    transfers = [*spans[tracks.TRAINER_RECEIVE], *spans[tracks.TRAINER_H2D]]
    fwd_bwds = [s for s in computations if dict(s.args).get("kind") == tracks.FWD_BWD]
    beside = [s for s in fwd_bwds if busy_time(transfers, s.start, s.end) > 0]
    self._alone.extend(s.duration for s in fwd_bwds if s not in beside)
    alone_s = statistics.median(self._alone) if self._alone else None
    figures: dict[str, Any] = {
        "step": self._step,
        # The host trainer's own count after this update (what its update answered: tunix's
        # train_steps, the step its loss is logged at); None where it answered none.
        "host_step": dict(update.args).get("host_step"),
        "step_s": None if prev_end is None else end - prev_end,
        "compute_s": busy,
        "input_wait_s": {"mid_step": mid_wait, "boundary": boundary},
        "other_s": busy_time(lanes, first if prev_end is None else prev_end, end),
        "microbatches": len(fwd_bwds),
        "compute": {
            "fwd_bwd_median_s": statistics.median(s.duration for s in fwd_bwds) if fwd_bwds
                                else None,
            "update_s": update.duration,
            "alone_s": alone_s,
            "beside_transfer": len(beside),
            "slowdown_s": (None if alone_s is None else
                           sum(max(0.0, s.duration - alone_s) for s in beside)),
        },
        "receive": _receives(spans[tracks.TRAINER_RECEIVE]),
        "place": _placements(spans[tracks.TRAINER_H2D]),
        "pool": {"waits": len(spans[tracks.TRAINER_POOL_WAIT]),
                 "wait_s": sum(s.duration for s in spans[tracks.TRAINER_POOL_WAIT]),
                 "over_bound": sum(bool(dict(s.args).get("over"))
                                   for s in spans[tracks.TRAINER_POOL_WAIT])},
        "staged": dict(zip(("peak_device", "peak_host"),
                           self.peaks() if self.peaks is not None else (None, None))),
    }
    wait = mid_wait + (boundary or 0.0)
    figures["bound_by"] = figures_lib.bound_by(
        figures["step_s"] if prev_end is not None else busy + wait + figures["other_s"], wait,
        figures["compute"]["slowdown_s"])
    self._step += 1
    return figures


def _receives(spans: list[Span]) -> dict[str, Any]:
  by_transport = figures_lib.transports(
      ((dict(s.args)["transport"], 1, dict(s.args)["bytes"], s.duration) for s in spans),
      rate=False)
  return {"calls": len(spans), "bytes": sum(t["bytes"] for t in by_transport.values()),
          "seconds": sum(s.duration for s in spans), "by_transport": by_transport}


def _placements(spans: list[Span]) -> dict[str, Any]:
  lanes = collections.Counter(dict(s.args)["lane"] for s in spans)
  return {"count": len(spans), "seconds": sum(s.duration for s in spans),
          "bytes": sum(dict(s.args)["bytes"] for s in spans),
          "staged": lanes["staging"], "inline": lanes["inline"]}


# ---------------------------------------------------------------- the orchestrator's steps

# What a fallback can be (core.pipeline.Fallback's status), counted per step in this order.
FALLBACK_KINDS = tuple(status for status in contract.StageStatus
                       if status is not contract.StageStatus.STAGED)


class OrchestratorSteps:
  """A Sink of the orchestrator's spans; `step(report)` makes a step's figures once its
  bookkeeping is done. Spans of a call that carries no step (outside the pipeline) count in the
  next step made."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._spans: dict[int | None, list[Span]] = collections.defaultdict(list)
    self._last: float | None = None

  def record(self, span: Span) -> None:
    if span.track not in (tracks.ORCHESTRATOR_STAGE, tracks.ORCHESTRATOR_SEND):
      return
    with self._lock:
      self._spans[dict(span.args).get("step")].append(span)

  def step(self, report: Any, depth: int, host_step: int | None = None) -> dict[str, Any]:
    """The figures of the step `report` (a core.pipeline.StepReport) describes; `host_step`:
    the trainer's step count after the step's update (None: the host's answer carried none)."""
    now = time.perf_counter()
    with self._lock:
      spans = self._spans.pop(report.step, []) + self._spans.pop(None, [])
      step_s = None if self._last is None else now - self._last
      self._last = now
    stages = [s.duration for s in spans if s.track == tracks.ORCHESTRATOR_STAGE]
    kinds = collections.Counter(f.status for f in report.fallback_reasons)
    return {
        "step": report.step,
        "host_step": host_step,
        "step_s": step_s,
        "microbatches": report.trained,
        "depth": depth,
        "staged": report.staged,
        "inline": report.inline,
        "prestaged": report.prestaged,
        "peak_staged": report.peak_staged,
        "fallbacks": {"count": report.fallbacks,
                      "by_kind": {k.value: kinds[k] for k in FALLBACK_KINDS if kinds[k]}},
        "sent": _sent([s for s in spans if s.track == tracks.ORCHESTRATOR_SEND]),
        "stage_calls": {"count": len(stages), "seconds": sum(stages),
                        "median_s": statistics.median(stages) if stages else None,
                        "max_s": max(stages, default=None)},
    }


def _sent(spans: list[Span]) -> dict[str, dict[str, Any]]:
  sent = (dict(s.args) | {"seconds": s.duration} for s in spans)
  return figures_lib.transports((a["transport"], 1, a["bytes"], a["seconds"]) for a in sent
                             if a["bytes"] is not None)  # None: a call that crossed no wire
