"""The spans one process records of its staging path, told to whatever listens (its sinks).

A span is (track, name, start, end, args) in seconds of the process's `time.perf_counter`,
recorded where the work happens by code that knows nothing of who listens (the step aggregators,
tunix's PerfTracer through hosts/tunix/tracing.py, a bench's kept spans). A recorder with no sink
costs one branch per span; a sink that raises is dropped with one line: telemetry never fails a
job. docs/observability.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
import time
from typing import Any, Iterable, Iterator, Protocol

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
