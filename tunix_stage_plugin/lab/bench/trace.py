"""The bench's spans: kept (a recorder that keeps what it records), moved onto one clock, and
written as a Chrome / Perfetto trace: one process per mode run, one thread per track.

Production records spans (core.telemetry.recorder) and keeps none; the bench keeps its own and
the trainer's, shifts the trainer's onto its clock with an offset measured at connect time
(`clock_offset`, `shifted`), and writes them. Open the trace at https://ui.perfetto.dev or
chrome://tracing. Every run is drawn from its own start (time 0), so the modes line up for
comparison. docs/bench.md.
"""

from __future__ import annotations

import dataclasses
import json
import time
import threading
from typing import Any, Awaitable, Callable, Iterable, Sequence

from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.core.telemetry.recorder import Span
from tunix_stage_plugin.lab.bench import results


class Kept(recorder_lib.Recorder):
  """A recorder that keeps every span it records, and every span it is told of as another
  recorder's sink (`record`): the bench's timeline of one process."""

  def __init__(self) -> None:
    super().__init__()
    self._kept_lock = threading.Lock()
    self._spans: list[Span] = []
    self.add_sink(self)

  def record(self, span: Span) -> None:
    with self._kept_lock:
      self._spans.append(span)

  def spans(self, track: str | None = None) -> list[Span]:
    with self._kept_lock:
      return [s for s in self._spans if track is None or s.track == track]

  def clear(self) -> None:
    with self._kept_lock:
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


def write_trace(path: str, runs: Sequence[results.ModeRun]) -> None:
  groups = {f"{r.mode} (round {r.round + 1})": shifted(r.spans, -r.origin) for r in runs}
  write_chrome_trace(path, groups)
