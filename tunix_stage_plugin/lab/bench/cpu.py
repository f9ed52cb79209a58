"""CPU used by *other* processes while a benchmark mode runs (Linux /proc; None elsewhere).

On a 2-core machine one foreign busy core can double the compute time, so a
figure measured under outside load is noise. The benchmark samples the foreign load per step,
takes its medians over the quiet steps (<= QUIET_CORES) and re-runs a mode run with no quiet step (docs/bench.md).
"""

from __future__ import annotations

import os
import time
from typing import Iterable

QUIET_CORES = 0.2
MIN_WINDOW_S = 0.5  # /proc counts 10 ms ticks: a shorter window says nothing


def _busy_ticks() -> int | None:
  try:
    with open("/proc/stat", encoding="ascii") as f:
      fields = [int(x) for x in f.readline().split()[1:]]
  except OSError:
    return None
  idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
  return sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal


def _process_ticks(pid: int) -> int:
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except OSError:
    return 0
  return int(fields[11]) + int(fields[12])  # utime + stime, all threads


class ForeignLoad:
  """Cores used by processes other than `pids`: between start() and each lap()."""

  def __init__(self, pids: Iterable[int]) -> None:
    self.pids = list(pids)
    self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    self._start: tuple[float, int, int] | None = None

  def _sample(self) -> tuple[float, int, int] | None:
    busy = _busy_ticks()
    if busy is None:
      return None
    return time.monotonic(), busy, sum(_process_ticks(p) for p in self.pids)

  def start(self) -> None:
    self._start = self._sample()

  def lap(self) -> float | None:
    """The foreign cores since start() or the previous lap(); None if unknown or too short."""
    end = self._sample()
    start, self._start = self._start, end
    if start is None or end is None or end[0] - start[0] < MIN_WINDOW_S:
      return None
    foreign = (end[1] - start[1]) - (end[2] - start[2])
    return max(0.0, foreign / self._hz / (end[0] - start[0]))
