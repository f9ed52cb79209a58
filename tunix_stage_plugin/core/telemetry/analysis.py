"""What a step's figures say: which part bounds the step and what staging hid against an inline
estimate (which setting held staging back: advice.py). Read by the per-step line, the records and
`tunix-stage report` alike, so they never disagree. docs/observability.md "Reading the figures".
"""

from __future__ import annotations

import statistics
from array import array
from typing import Any, Iterable, Sequence

from tunix_stage_plugin.core.telemetry import steps as steps_lib

# A part of a step counts once it is at least this share of the step, and at least FLOOR_S.
SHARE = 0.05
FLOOR_S = 0.02
COMPUTE, WIRE, SHARED_CORES = "compute", "wire", "shared cores"
GIB = 1 << 30
# How `summary` counts, said once where its figures are shown (the report's header).
RULE = "medians per step leave a first step out where there are others; totals are over every step"


def judged(steps: steps_lib.Steps) -> Sequence[int]:
  """The rows of `steps` a median is taken over (RULE): a first step, which has no step before
  it and compiles, left out where there are others."""
  rows = array("q", (i for i, s in enumerate(steps.columns["step_s"]) if s == s))  # NaN: null
  if not rows:
    return range(len(steps))
  return range(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else rows


def significant(seconds: float | None, step_s: float) -> bool:
  return seconds is not None and seconds >= max(SHARE * step_s, FLOOR_S)


def input_wait(figures: dict[str, Any]) -> float:
  """A trainer step's input wait, mid-step and at the boundary."""
  wait = figures["input_wait_s"]
  return waited(wait["mid_step"], wait["boundary"])


def waited(mid_step: float, boundary: float | None) -> float:
  return mid_step + (boundary or 0.0)


def step_seconds(figures: dict[str, Any]) -> float:
  """The step's length (its first has none from the step before: its parts then)."""
  return lasted(figures["step_s"], figures["compute_s"], input_wait(figures), figures["other_s"])


def lasted(step_s: float | None, compute_s: float, wait: float, other_s: float) -> float:
  return step_s if step_s is not None else compute_s + wait + other_s


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
  place, receive = figures["place"], figures["receive"]
  return estimated(input_wait(figures), place["staged"], receive["seconds"], receive["calls"],
                   place["seconds"], place["count"])


def estimated(wait: float, staged_: int, receive_s: float, receives: int, place_s: float,
              places: int) -> float:
  if not staged_:
    return wait
  per_receive = receive_s / receives if receives else 0.0
  return wait + staged_ * (per_receive + place_s / places)


def staged(steps: steps_lib.Steps, rows: Sequence[int]) -> Sequence[int]:
  """The `rows` of trainer steps that staged a micro-batch (placed one on the staging lane); the
  others ran inline (staging off, or every stage fell back)."""
  column = steps.columns["place.staged"]
  picked = array("q", (i for i in rows if column[i]))
  return rows if len(picked) == len(rows) else picked


def _median(values: list[float]) -> float | None:
  return statistics.median(values) if values else None


def summary(trainer: steps_lib.Steps, orchestrator: steps_lib.Steps) -> dict[str, Any]:
  """A job's figures over its steps (columns: core.telemetry.steps), what staging hid, the
  transports' speeds and what held staging back. One rule, said in the report's header (RULE):
  medians per step leave a first step out where there are others (it compiles and has no step
  before it); totals and counts (how many steps each part bounded, what was received and sent)
  are over every step, as the tables they sum. What held staging back: core.telemetry.advice."""
  out: dict[str, Any] = {"trainer_steps": len(trainer), "orchestrator_steps": len(orchestrator)}
  if len(trainer):
    rows = judged(trainer)
    f = {name: trainer.values(name, rows) for name in (
        "step_s", "compute_s", "input_wait_s.mid_step", "input_wait_s.boundary", "other_s",
        "compute.slowdown_s", "place.staged", "receive.seconds", "receive.calls",
        "place.seconds", "place.count")}
    wait = array("d", map(waited, f["input_wait_s.mid_step"], f["input_wait_s.boundary"]))
    staged_ = array("q", (i for i, n in enumerate(f["place.staged"]) if n))  # of rows
    paths = {"staged": staged_,
             "inline": array("q", (i for i, n in enumerate(f["place.staged"]) if not n))}
    waits = {path: array("d", (wait[i] for i in group)) for path, group in paths.items()}
    hid_in = staged_ or range(len(rows))  # what staging hid: in the steps that staged
    estimate = array("d", (estimated(wait[i], f["place.staged"][i], f["receive.seconds"][i],
                                     f["receive.calls"][i], f["place.seconds"][i],
                                     f["place.count"][i]) for i in hid_in))
    bound = trainer.values("bound_by")
    out["trainer"] = {
        "step_s": statistics.median(map(lasted, f["step_s"], f["compute_s"], wait,
                                        f["other_s"])),
        "compute_s": statistics.median(f["compute_s"]),
        "input_wait_s": statistics.median(waits["staged"] + waits["inline"]),
        "mid_step_s": statistics.median(f["input_wait_s.mid_step"]),
        "boundary_s": _median([b for b in f["input_wait_s.boundary"] if b is not None]),
        "other_s": statistics.median(f["other_s"]),
        "slowdown_s": _median([s for s in f["compute.slowdown_s"] if s is not None]),
        "bound_by": {b: bound.count(b) for b in (COMPUTE, WIRE, SHARED_CORES)},
        "inline_wait_estimate_s": statistics.median(estimate),
        "hidden_s": statistics.median(e - wait[i] for e, i in zip(estimate, hid_in)),
        "received": _transports(trainer.family("receive.by_transport")),
        # A record holding both (a job run staged and inline, or stages that fell back): each
        # path's input wait apart, so staging's effect is read off the job itself.
        "by_path": {path: {"steps": len(group), "input_wait_s": _median(waits[path])}
                    for path, group in paths.items()},
    }
  if len(orchestrator):
    timed = judged(orchestrator)  # the medians'
    o = orchestrator.columns
    out["orchestrator"] = {
        "staged": sum(o["staged"]), "inline": sum(o["inline"]),
        "prestaged": sum(o["prestaged"]), "fallbacks": sum(o["fallbacks.count"]),
        "fallbacks_by_kind": {k: sum(c) for k, c in orchestrator.family(
            "fallbacks.by_kind").items()},
        "stage_call_median_s": _median([s for s in orchestrator.values(
            "stage_calls.median_s", timed) if s is not None]),
        "sent": _transports(orchestrator.family("sent")),
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


def _transports(columns: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Per transport, its steps' figures (columns: core.telemetry.steps) summed."""
  return transports((name, sum(c["calls"]), sum(c["bytes"]), sum(c["seconds"]))
                    for name, c in columns.items())
