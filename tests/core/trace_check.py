"""Checks a Chrome/Perfetto trace the way the viewers need it: the complete events of a thread nest."""

from __future__ import annotations

import itertools
from typing import Any

TICKS_PER_US = 10  # the writer's resolution: ts and dur are whole tenths of a microsecond


def partial_overlaps(trace: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
  """Pairs of "X" events of one (pid, tid) that overlap without one containing the other."""
  by_thread: dict[tuple[int, int], list[tuple[int, int, dict[str, Any]]]] = {}
  for e in trace["traceEvents"]:
    if e.get("ph") == "X":
      start = round(e["ts"] * TICKS_PER_US)
      end = start + round(e["dur"] * TICKS_PER_US)
      by_thread.setdefault((e["pid"], e["tid"]), []).append((start, end, e))
  bad = []
  for events in by_thread.values():  # every pair: the traces checked are small
    for (s1, e1, a), (s2, e2, b) in itertools.combinations(events, 2):
      disjoint = e1 <= s2 or e2 <= s1
      nested = (s1 <= s2 and e2 <= e1) or (s2 <= s1 and e1 <= e2)
      if not (disjoint or nested):
        bad.append((a, b))
  return bad
