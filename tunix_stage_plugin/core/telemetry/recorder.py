"""The spans one process records of its staging path, told to whatever listens (its sinks).

Production code records a span where the work happens (a receive where its bytes end, a
placement on the staging lane, a stage call on the orchestrator's loop), each on its process's
perf_counter clock, and knows nothing of who listens: the step aggregators (trainer.py,
orchestrator.py), tunix's PerfTracer where a trainer has one (hosts/tunix/tracing.py), a bench's
timeline (the lab). A recorder with no sink costs one branch per span. A sink that raises is dropped with one line: telemetry never fails a job.
docs/observability.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from typing import Any, Iterator, Protocol

from tunix_stage_plugin.core import timeline as timeline_lib

log = logging.getLogger("tunix_stage_plugin")


class Sink(Protocol):
  """Told of each finished span (on the thread that recorded it; keep it short)."""

  def record(self, span: timeline_lib.Span) -> None:
    ...


class Spans(Protocol):
  """Where code records spans: a Recorder (production), or a lab's timeline directly."""

  def add(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
    ...

  def span(self, track: str, name: str, **args: Any
           ) -> contextlib.AbstractContextManager[dict[str, Any]]:
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
    span = timeline_lib.Span(track, name, start, end, tuple(sorted(args.items())))
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
    log.warning("tunix-stage: telemetry: %s failed (%s: %s) and was dropped; staging goes on",
                type(sink).__name__, type(error).__name__, error)


class _Disabled(Recorder):
  """A recorder that never takes a sink (the default of code given none)."""

  def add_sink(self, sink: Sink) -> None:
    raise RuntimeError("this recorder is disabled; make a Recorder() to record")


DISABLED = _Disabled()

# The pipeline's call in progress on this task: (step, micro-batch index), so that what a call
# sends on the way down (a route recording its transport) is counted in its step.
CALL: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "tunix_stage_call", default=None)
