"""Spans on named tracks, idle-time arithmetic, and Chrome/Perfetto trace export.

A span is (track, name, start, end) in seconds of one process's `time.perf_counter`. Processes
that trade timelines (the benchmark's trainer and orchestrator) shift them onto one clock with an
offset measured at connect time; see `shifted`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from typing import Any, Iterable, Iterator


@dataclasses.dataclass(frozen=True)
class Span:
  track: str
  name: str
  start: float
  end: float
  args: tuple[tuple[str, Any], ...] = ()

  @property
  def duration(self) -> float:
    return self.end - self.start


class Timeline:
  """Thread-safe span recorder. Disabled timelines record nothing and cost one branch."""

  def __init__(self, *, enabled: bool = True) -> None:
    self.enabled = enabled
    self._lock = threading.Lock()
    self._spans: list[Span] = []

  def add(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
    if self.enabled:
      with self._lock:
        self._spans.append(Span(track, name, start, end, tuple(sorted(args.items()))))

  @contextlib.contextmanager
  def span(self, track: str, name: str, **args: Any) -> Iterator[None]:
    start = time.perf_counter()
    try:
      yield
    finally:
      self.add(track, name, start, time.perf_counter(), **args)

  def spans(self, track: str | None = None) -> list[Span]:
    with self._lock:
      return [s for s in self._spans if track is None or s.track == track]

  def extend(self, spans: Iterable[Span]) -> None:
    if self.enabled:
      with self._lock:
        self._spans.extend(spans)

  def clear(self) -> None:
    with self._lock:
      self._spans.clear()


def shifted(spans: Iterable[Span], offset: float, prefix: str = "") -> list[Span]:
  """Moves spans by `offset` seconds (onto another process's clock), optionally renaming tracks."""
  return [dataclasses.replace(s, track=prefix + s.track, start=s.start + offset,
                              end=s.end + offset) for s in spans]


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


def to_chrome_trace(groups: dict[str, Iterable[Span]], origin: float = 0.0) -> dict[str, Any]:
  """Chrome/Perfetto JSON: one process per group (e.g. per benchmark mode), one thread per track."""
  events: list[dict[str, Any]] = []
  for pid, (group, spans) in enumerate(groups.items(), start=1):
    events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": group}})
    tids: dict[str, int] = {}
    for s in sorted(spans, key=lambda s: s.start):
      if s.track not in tids:
        tids[s.track] = len(tids) + 1
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[s.track],
                       "args": {"name": s.track}})
      events.append({"ph": "X", "name": s.name, "pid": pid, "tid": tids[s.track],
                     "ts": round((s.start - origin) * 1e6, 1), "dur": round(s.duration * 1e6, 1),
                     "args": dict(s.args)})
  return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, groups: dict[str, Iterable[Span]], origin: float = 0.0) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(to_chrome_trace(groups, origin), f)
