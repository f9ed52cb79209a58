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
from typing import Any, Awaitable, Callable, Iterable, Iterator, Sequence


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
  def span(self, track: str, name: str, **args: Any) -> Iterator[dict[str, Any]]:
    """Times the block; yields its args (the block may add to them)."""
    start = time.perf_counter()
    try:
      yield args
    finally:
      self.add(track, name, start, time.perf_counter(), **args)

  def record(self, span: Span) -> None:
    """As a telemetry sink (core.telemetry.recorder.Sink): keeps the span."""
    if self.enabled:
      with self._lock:
        self._spans.append(span)

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


async def clock_offset(remote_clock: Callable[[], Awaitable[float]], samples: int = 7
                       ) -> tuple[float, float]:
  """(offset, uncertainty): the other process's perf_counter (as `remote_clock` asks it) +
  offset = this process's. Takes the sample with the shortest round trip; its error is at most
  half that round trip."""
  best: tuple[float, float] | None = None
  for _ in range(samples):
    t0 = time.perf_counter()
    remote = await remote_clock()
    t1 = time.perf_counter()
    if best is None or t1 - t0 < 2 * best[1]:
      best = ((t0 + t1) / 2 - remote, (t1 - t0) / 2)
  assert best is not None
  return best


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


LANE_MARK = " #"  # "trainer/h2d #2": the second lane of track trainer/h2d


def lane_track(thread_name: str) -> str:
  """The track a trace thread (lane) belongs to: "trainer/h2d #2" -> "trainer/h2d"."""
  track, mark, number = thread_name.rpartition(LANE_MARK)
  return track if mark and number.isdigit() else thread_name


def assign_lanes(intervals: Sequence[tuple[float, float]]) -> list[int]:
  """A lane (0, 1, ...) for each (start, end) of one track, so that the intervals of a lane nest.

  Chrome/Perfetto draw one thread's complete events as a stack: two that partially overlap
  (the receive of payload k+1 starting before payload k's ends) break it. Greedy interval
  partitioning in start order (the longer first at a tie): an interval goes on the first lane
  whose open intervals it fits inside (it ends by the time the innermost still-open one ends),
  else on a new lane. Intervals that only touch (one ends where the next starts) share a lane.
  """
  lanes: list[list[float]] = []  # per lane, the ends of its open intervals, innermost last
  out = [0] * len(intervals)
  for i in sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -intervals[i][1])):
    start, end = intervals[i]
    for lane, stack in enumerate(lanes):
      while stack and stack[-1] <= start:
        stack.pop()
      if not stack or end <= stack[-1]:
        stack.append(end)
        out[i] = lane
        break
    else:
      lanes.append([end])
      out[i] = len(lanes) - 1
  return out


TICKS_PER_US = 10  # trace times are whole tenths of a microsecond


def to_chrome_trace(groups: dict[str, Iterable[Span]], origin: float = 0.0) -> dict[str, Any]:
  """Chrome/Perfetto JSON: one process per group (e.g. per benchmark mode), one thread per track.

  A track whose spans partially overlap gets more threads ("lanes"): "trainer/h2d",
  "trainer/h2d #2", ... (assign_lanes; lane_track reads the track back), so every thread's
  complete events nest as the trace viewers require. Lanes are chosen on the times as written
  (rounded to 0.1 us), so rounding cannot make two events of a lane overlap.
  """
  events: list[dict[str, Any]] = []
  for pid, (group, spans) in enumerate(groups.items(), start=1):
    events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": group}})
    spans = sorted(spans, key=lambda s: s.start)
    ticks = [(round((s.start - origin) * 1e6 * TICKS_PER_US),
              round((s.end - origin) * 1e6 * TICKS_PER_US)) for s in spans]
    lane_of: dict[int, int] = {}
    for track in dict.fromkeys(s.track for s in spans):
      indexes = [i for i, s in enumerate(spans) if s.track == track]
      lane_of.update(zip(indexes, assign_lanes([ticks[i] for i in indexes])))
    tids: dict[tuple[str, int], int] = {}
    for i, s in enumerate(spans):
      key = (s.track, lane_of[i])
      if key not in tids:
        tids[key] = len(tids) + 1
        name = s.track if key[1] == 0 else f"{s.track}{LANE_MARK}{key[1] + 1}"
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[key],
                       "args": {"name": name}})
      start, end = ticks[i]
      events.append({"ph": "X", "name": s.name, "pid": pid, "tid": tids[key],
                     "ts": start / TICKS_PER_US, "dur": (end - start) / TICKS_PER_US,
                     "args": dict(s.args)})
  return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, groups: dict[str, Iterable[Span]], origin: float = 0.0) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(to_chrome_trace(groups, origin), f)
