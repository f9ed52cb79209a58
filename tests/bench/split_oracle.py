"""The bench's own step split of old, kept as a test oracle: each step's time, device idle and
compute straight from its device compute spans (by their `step` args), written independently of
the trainer's split (core.telemetry.recorder.TrainerSteps) that the bench now reads.

For step i: step seconds = end of step i's update - end of step i-1's; mid-step idle = the time
between step i's first compute start and its last end that no compute span covers; boundary
idle = step i's first compute start - step i-1's end.
"""

from __future__ import annotations

from typing import Iterable

from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry.recorder import Span


def step_timings(spans: Iterable[Span], steps: Iterable[int]
                 ) -> list[tuple[int, float, float, float, float]]:
  """(step, seconds, mid-step idle, boundary idle, compute) of each of `steps`."""
  by_step: dict[int, list[Span]] = {}
  for span in spans:
    if span.track == tracks.DEVICE_COMPUTE:
      by_step.setdefault(dict(span.args)["step"], []).append(span)
  out = []
  for step in steps:
    mine, before = by_step[step], by_step[step - 1]
    prev_end = max(s.end for s in before)
    first, last = min(s.start for s in mine), max(s.end for s in mine)
    busy, cursor = 0.0, first
    for lo, hi in sorted((s.start, s.end) for s in mine):
      lo = max(lo, cursor)
      if hi > lo:
        busy, cursor = busy + hi - lo, hi
    out.append((step, last - prev_end, (last - first) - busy, first - prev_end, busy))
  return out
