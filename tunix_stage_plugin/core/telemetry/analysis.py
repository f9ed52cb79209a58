"""What a step's figures say: which part bounds the step and what staging hid against an inline
estimate (which setting held staging back: advice.py). Read by the per-step line, the records and
`tunix-stage report` alike, so they never disagree. docs/observability.md "Reading the figures".
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

# A part of a step counts once it is at least this share of the step, and at least FLOOR_S.
SHARE = 0.05
FLOOR_S = 0.02
COMPUTE, WIRE, SHARED_CORES = "compute", "wire", "shared cores"
GIB = 1 << 30
# How `summary` counts, said once where its figures are shown (the report's header).
RULE = "medians per step leave a first step out where there are others; totals are over every step"


def judged(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The steps a median is taken over (RULE): a first step, which has no step before it and
  compiles, left out where there are others."""
  return [f for f in steps if f["step_s"] is not None] or steps


def significant(seconds: float | None, step_s: float) -> bool:
  return seconds is not None and seconds >= max(SHARE * step_s, FLOOR_S)


def input_wait(figures: dict[str, Any]) -> float:
  """A trainer step's input wait, mid-step and at the boundary."""
  wait = figures["input_wait_s"]
  return wait["mid_step"] + (wait["boundary"] or 0.0)


def step_seconds(figures: dict[str, Any]) -> float:
  """The step's length (its first has none from the step before: its parts then)."""
  if figures["step_s"] is not None:
    return figures["step_s"]
  return figures["compute_s"] + input_wait(figures) + figures["other_s"]


def bound_by(figures: dict[str, Any]) -> str:
  """What bounds a trainer step: WIRE (the device waited for its input: the host path was on the
  critical path), SHARED_CORES (the compute ran slower while transfers ran beside it on the same
  cores), else COMPUTE."""
  step = step_seconds(figures)
  if significant(input_wait(figures), step):
    return WIRE
  if significant(figures["compute"]["slowdown_s"], step):
    return SHARED_CORES
  return COMPUTE


def inline_estimate(figures: dict[str, Any]) -> float:
  """The input wait a trainer step would have had inline: each micro-batch staged in it would
  have received and been placed between two computations. An upper bound (tunix answers a call
  once its computation is queued, so its own loop overlaps part of the next call's transfer)."""
  staged = figures["place"]["staged"]
  if not staged:
    return input_wait(figures)
  receive = figures["receive"]
  per_receive = receive["seconds"] / receive["calls"] if receive["calls"] else 0.0
  per_place = figures["place"]["seconds"] / figures["place"]["count"]
  return input_wait(figures) + staged * (per_receive + per_place)


def staged(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The trainer steps that staged a micro-batch (placed one on the staging lane); the others
  ran inline (staging off, or every stage fell back)."""
  return [f for f in steps if f["place"]["staged"]]


def _median(values: list[float]) -> float | None:
  return statistics.median(values) if values else None


def summary(trainer: list[dict[str, Any]], orchestrator: list[dict[str, Any]]
            ) -> dict[str, Any]:
  """A job's figures over its steps, what staging hid, the transports' speeds and what held
  staging back. One rule, said in the report's header (RULE): medians per step leave a first
  step out where there are others (it compiles and has no step before it); totals and counts
  (how many steps each part bounded, what was received and sent) are over every step, as the
  tables they sum. What held staging back: core.telemetry.advice."""
  steps = judged(trainer)
  out: dict[str, Any] = {"trainer_steps": len(trainer), "orchestrator_steps": len(orchestrator)}
  if steps:
    paths = {"staged": staged(steps), "inline": [f for f in steps if not f["place"]["staged"]]}
    waits = {path: [input_wait(f) for f in group] for path, group in paths.items()}
    hid_in = paths["staged"] or steps  # what staging hid: in the steps that staged
    wait = waits["staged"] or waits["inline"]  # hid_in's
    estimate = [inline_estimate(f) for f in hid_in]
    out["trainer"] = {
        "step_s": statistics.median(step_seconds(f) for f in steps),
        "compute_s": statistics.median(f["compute_s"] for f in steps),
        "input_wait_s": statistics.median(waits["staged"] + waits["inline"]),
        "mid_step_s": statistics.median(f["input_wait_s"]["mid_step"] for f in steps),
        "boundary_s": _median([f["input_wait_s"]["boundary"] for f in steps
                               if f["input_wait_s"]["boundary"] is not None]),
        "other_s": statistics.median(f["other_s"] for f in steps),
        "slowdown_s": _median([f["compute"]["slowdown_s"] for f in steps
                               if f["compute"]["slowdown_s"] is not None]),
        "bound_by": {b: [f["bound_by"] for f in trainer].count(b)
                     for b in (COMPUTE, WIRE, SHARED_CORES)},
        "inline_wait_estimate_s": statistics.median(estimate),
        "hidden_s": statistics.median(e - w for e, w in zip(estimate, wait)),
        "received": _transports([f["receive"]["by_transport"] for f in trainer]),
        # A record holding both (a job run staged and inline, or stages that fell back): each
        # path's input wait apart, so staging's effect is read off the job itself.
        "by_path": {path: {"steps": len(group), "input_wait_s": _median(waits[path])}
                    for path, group in paths.items()},
    }
  if orchestrator:
    timed = judged(orchestrator)  # the medians'
    out["orchestrator"] = {
        "staged": sum(f["staged"] for f in orchestrator),
        "inline": sum(f["inline"] for f in orchestrator),
        "prestaged": sum(f["prestaged"] for f in orchestrator),
        "fallbacks": sum(f["fallbacks"]["count"] for f in orchestrator),
        "fallbacks_by_kind": _counts([f["fallbacks"]["by_kind"] for f in orchestrator]),
        "stage_call_median_s": _median([f["stage_calls"]["median_s"] for f in timed
                                        if f["stage_calls"]["median_s"] is not None]),
        "sent": _transports([f["sent"] for f in orchestrator]),
    }
  return out


def transports(parts: Iterable[tuple[str, int, int, float]], *, rate: bool = True
               ) -> dict[str, dict[str, Any]]:
  """Per transport, the (transport, calls, bytes, seconds) of `parts` summed: a step's receives
  or sends, or a job's steps; with `rate`, their bytes over their seconds (`gib_s`)."""
  total: dict[str, dict[str, Any]] = {}
  for name, calls, nbytes, seconds in parts:
    t = total.setdefault(name, {"calls": 0, "bytes": 0, "seconds": 0.0})
    t["calls"] += calls
    t["bytes"] += nbytes
    t["seconds"] += seconds
  if rate:
    for t in total.values():
      t["gib_s"] = t["bytes"] / t["seconds"] / GIB if t["seconds"] > 0 else None
  return total


def _transports(per_step: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
  """Per transport, the steps' figures summed (a figure at a time: a job's steps are many)."""
  per_name = {name: [step[name] for step in per_step if name in step]
              for name in dict.fromkeys(name for step in per_step for name in step)}
  return transports((name, sum(t["calls"] for t in ts), sum(t["bytes"] for t in ts),
                     sum(t["seconds"] for t in ts)) for name, ts in per_name.items())


def _counts(per_step: list[dict[str, int]]) -> dict[str, int]:
  total: dict[str, int] = {}
  for step in per_step:
    for k, n in step.items():
      total[k] = total.get(k, 0) + n
  return total
