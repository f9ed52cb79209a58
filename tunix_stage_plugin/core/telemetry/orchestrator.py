"""The orchestrator's side: one figures dict per step, from the pipeline's step report and the
spans its calls recorded (each stage call; each call carrying a micro-batch, by the transport that
sent it). docs/observability.md "The record".
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from typing import Any

from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib

# What a fallback can be (core.pipeline.Fallback's status), counted per step in this order.
FALLBACK_KINDS = tuple(status for status in outcome_lib.StageStatus
                       if status is not outcome_lib.StageStatus.STAGED)


class OrchestratorSteps:
  """A Sink of the orchestrator's spans; `step(report)` makes a step's figures once its
  bookkeeping is done. Spans of a call that carries no step (outside the pipeline) count in the
  next step made."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._spans: dict[int | None, list[recorder_lib.Span]] = collections.defaultdict(list)
    self._last: float | None = None

  def record(self, span: recorder_lib.Span) -> None:
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


def _sent(spans: list[recorder_lib.Span]) -> dict[str, dict[str, Any]]:
  sent = (dict(s.args) | {"seconds": s.duration} for s in spans)
  return figures_lib.transports((a["transport"], 1, a["bytes"], a["seconds"]) for a in sent
                             if a["bytes"] is not None)  # None: a call that crossed no wire
