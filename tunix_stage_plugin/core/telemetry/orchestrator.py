"""The orchestrator's side: one figures dict per step, from the pipeline's step report and the
spans its calls recorded (each stage call; each call carrying a micro-batch, by the transport that
sent it). docs/observability.md "The orchestrator's record".
"""

from __future__ import annotations

import collections
import statistics
import threading
import time
from typing import Any

from tunix_stage_plugin.core import timeline as timeline_lib
from tunix_stage_plugin.core import tracks

GIB = 1 << 30
# A fallback reason starts with what happened (core.pipeline: "refused: ...", "failed: ...",
# "unsupported: ...", "unplaced: ..."): its kind, counted per step.
FALLBACK_KINDS = ("refused", "failed", "unsupported", "unplaced")


class OrchestratorSteps:
  """A Sink of the orchestrator's spans; `step(report)` makes a step's figures once its
  bookkeeping is done. Spans of a call that carries no step (outside the pipeline) count in the
  next step made."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._spans: dict[int | None, list[timeline_lib.Span]] = collections.defaultdict(list)
    self._last: float | None = None

  def record(self, span: timeline_lib.Span) -> None:
    if span.track not in (tracks.ORCHESTRATOR_STAGE, tracks.ORCHESTRATOR_SEND):
      return
    with self._lock:
      self._spans[dict(span.args).get("step")].append(span)

  def step(self, report: Any, depth: int) -> dict[str, Any]:
    """The figures of the step `report` (a core.pipeline.StepReport) describes."""
    now = time.perf_counter()
    with self._lock:
      spans = self._spans.pop(report.step, []) + self._spans.pop(None, [])
      step_s = None if self._last is None else now - self._last
      self._last = now
    stages = [s.duration for s in spans if s.track == tracks.ORCHESTRATOR_STAGE]
    kinds = collections.Counter(r.split(":", 1)[0] for r in report.fallback_reasons)
    return {
        "step": report.step,
        "step_s": step_s,
        "microbatches": report.trained,
        "depth": depth,
        "staged": report.staged,
        "inline": report.inline,
        "prestaged": report.prestaged,
        "peak_staged": report.peak_staged,
        "fallbacks": {"count": report.fallbacks,
                      "by_kind": {k: kinds[k] for k in FALLBACK_KINDS if kinds[k]}},
        "sent": _sent([s for s in spans if s.track == tracks.ORCHESTRATOR_SEND]),
        "stage_calls": {"count": len(stages), "seconds": sum(stages),
                        "median_s": statistics.median(stages) if stages else None,
                        "max_s": max(stages, default=None)},
    }


def _sent(spans: list[timeline_lib.Span]) -> dict[str, dict[str, Any]]:
  out: dict[str, dict[str, Any]] = {}
  for s in spans:
    args = dict(s.args)
    if args["bytes"] is None:  # a call that crossed no wire (an in-process handle)
      continue
    t = out.setdefault(args["transport"], {"calls": 0, "bytes": 0, "seconds": 0.0})
    t["calls"] += 1
    t["bytes"] += args["bytes"]
    t["seconds"] += s.duration
  for t in out.values():
    t["gib_s"] = t["bytes"] / t["seconds"] / GIB if t["seconds"] > 0 else None
  return out
