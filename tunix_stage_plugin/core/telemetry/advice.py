"""What to change in a job: the one rule that reads a window of its step figures and names the
setting that held staging back, to what, the figure that decided it and what it costs. `tunix-stage
report` prints it (checked against the simulator where the lab is installed), and a pipeline that
sizes itself asks the same rule. docs/observability.md "Reading the figures".
"""

from __future__ import annotations

import dataclasses
import math
import operator
import statistics
from array import array
from typing import Any, Sequence

from tunix_stage_plugin.core import outcome
from tunix_stage_plugin.core.telemetry import analysis
from tunix_stage_plugin.core.telemetry import record
from tunix_stage_plugin.core.telemetry import steps as steps_lib

# A cause counts once it held at least this share of the window's steps (and one step): a cause
# in a minority of the steps still costs time, and the simulator judges whether a change helps.
STEP_SHARE = 0.25
# The depth a self-sizing pipeline keeps is the stages a compute spans, with a cushion for a stage
# this many times its recent length (the upstream change's production measurements: 2x transient
# gRPC contention spikes).
SPIKE = 2.0
MIB = 1 << 20

# The advice's kinds: one per row of docs/observability.md "Reading the figures".
HOST_BOUND, DEVICE_BOUND, DEPTH, PRESTAGE, WIRE, CORES = (
    "host bound", "device bound", "depth", "prestage", "wire", "shared cores")
# How each orchestrating host lets its loop stage the next step across the boundary (a trainer
# behind tunix's worker, MaxText's, is driven by tunix's program).
PRESTAGE_KNOBS = {
    "tunix": "let the program prestage (max_staleness >= 1, and _prestage_across_boundary "
             "answering True)",
    "embedded": "TUNIX_MAX_STAGED_BATCHES={depth} (the embedded job prestages at a depth of 2 "
                "or more)",
}


@dataclasses.dataclass(frozen=True)
class Settings:
  """The settings a window ran with: what an advice changes (and the simulator replays)."""

  host: str  # the orchestrating host, which names the prestage knob (PRESTAGE_KNOBS)
  depth: int
  prestage: bool | None  # None: not known (no orchestrator figures)
  max_device_batches: int
  max_host_batches: int

  @property
  def mode(self) -> str:
    """The simulator's mode for these settings (lab/sim/run.plan_of)."""
    return f"depth{self.depth}" + ("_prestage" if self.prestage else "")


@dataclasses.dataclass(frozen=True)
class Change:
  """What an advice changes: the settings it sets, and a factor on the wire's time."""

  depth: int | None = None
  prestage: bool | None = None
  max_device_batches: int | None = None
  max_host_batches: int | None = None
  wire: float = 1.0

  def applied(self, settings: Settings) -> Settings:
    return dataclasses.replace(settings, **{f.name: getattr(self, f.name) for f in
                                            dataclasses.fields(self) if f.name != "wire"
                                            and getattr(self, f.name) is not None})


@dataclasses.dataclass(frozen=True)
class Figure:
  """The figure that decided an advice: its name, its mean over the window's steps (seconds, or
  a count with `unit` ''), and in how many of them the cause held."""

  name: str
  value: float
  steps: int
  of: int
  unit: str = "s a step"

  def __str__(self) -> str:
    value = f"{self.value:.2f} {self.unit}" if self.unit else f"{self.value:g}"
    return f"{self.name} {value} (in {self.steps} of {self.of} steps)"


@dataclasses.dataclass(frozen=True)
class Advice:
  kind: str  # one of the kinds above
  setting: str  # what to change, to what: a variable's assignment or a knob in words
  figure: Figure
  cost: str  # in memory
  why: str  # what the figures say, and what cannot help
  change: Change | None  # None: nothing staging sets (the simulator cannot try it)

  def line(self) -> str:
    return f"{self.setting}: {self.why}; decided by {self.figure}; costs {self.cost}"

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Window:
  """The step figures the rule reads, a value per step (the trainer's), and the job's."""

  settings: Settings
  step_s: Sequence[float]
  mid_step_s: Sequence[float]
  boundary_s: Sequence[float]  # 0 where not known (a first step)
  pool_wait_s: Sequence[float]
  over_bound: int  # transfers that ran out of their wait for a receive buffer
  bound_by: tuple[str, ...]
  refused: tuple[int, ...]  # stages refused by a full bound, per orchestrator step
  depth_full: bool  # every step kept its depth's micro-batches staged ahead
  transfer_s: float | None  # a micro-batch on the wire (its receive, else its stage call)
  place_s: float | None  # a micro-batch's placement
  stage_s: float | None  # a micro-batch's receive and placement, the longest step's mean
  compute_s: float | None  # a micro-batch's fwd_bwd
  microbatch_bytes: float | None

  @classmethod
  def of_records(cls, trainer: list[dict[str, Any]], orchestrator: list[dict[str, Any]]
                 ) -> "Window | None":
    """The window of a job's records (a few, whole: a pipeline sizing itself, the simulator)."""
    return cls.of_steps(steps_lib.Steps.of(record.TRAINER, trainer),
                        steps_lib.Steps.of(record.ORCHESTRATOR, orchestrator))

  @classmethod
  def of_steps(cls, trainer: steps_lib.Steps, orchestrator: steps_lib.Steps) -> "Window | None":
    """The window of a job's steps (their columns): the trainer steps after the first (which
    compiles and has no step before it) that staged, where there are any (an inline step's wait
    says nothing of a staging setting); None with no trainer step."""
    if not len(trainer):
      return None
    rows = analysis.judged(trainer)
    rows = analysis.staged(trainer, rows) or rows
    f = {name: trainer.values(name, rows) for name in (
        "step_s", "compute_s", "input_wait_s.mid_step", "input_wait_s.boundary", "other_s",
        "receive.seconds", "receive.calls", "place.seconds", "place.count", "place.bytes",
        "pool.wait_s", "pool.over_bound", "bound_by", "compute.fwd_bwd_median_s")}
    o = {name: orchestrator.values(name) for name in (
        "depth", "prestaged", "peak_staged", "stage_calls.median_s", "stage_calls.max_s")}
    last = trainer.last
    ran = orchestrator.last if len(orchestrator) else None
    settings = Settings(
        host=(ran or last)["host"],
        depth=o["depth"][-1] if ran else record.setting(last, "max_staged_batches"),
        prestage=any(o["prestaged"]) if ran else None,
        max_device_batches=record.setting(last, "max_device_batches"),
        max_host_batches=record.setting(last, "max_host_batches"))
    receives = array("d", map(_per, f["receive.seconds"], f["receive.calls"]))
    places = array("d", map(_per, f["place.seconds"], f["place.count"]))
    # A micro-batch's crossing: its receive on the trainer; where the trainer timed none (tunix's
    # own unary call is received before any hook sees it), the orchestrator's stage call.
    if any(f["receive.calls"]):
      transfer_s = _median([r for r, n in zip(receives, f["receive.calls"]) if n])
      stage_s = max(map(operator.add, receives, places))
    else:
      transfer_s = _median([s for s in o["stage_calls.median_s"] if s is not None])
      stage_s = max((s for s in o["stage_calls.max_s"] if s is not None), default=None)
    refused = orchestrator.family("fallbacks.by_kind").get(outcome.StageStatus.REFUSED.value)
    wait = map(analysis.waited, f["input_wait_s.mid_step"], f["input_wait_s.boundary"])
    return cls(
        settings=settings,
        step_s=array("d", map(analysis.lasted, f["step_s"], f["compute_s"], wait, f["other_s"])),
        mid_step_s=array("d", f["input_wait_s.mid_step"]),
        boundary_s=array("d", (b or 0.0 for b in f["input_wait_s.boundary"])),
        pool_wait_s=array("d", f["pool.wait_s"]),
        over_bound=sum(f["pool.over_bound"]),
        bound_by=tuple(f["bound_by"]),
        refused=tuple(refused) if refused is not None else (0,) * len(orchestrator),
        depth_full=bool(ran) and all(p >= d for p, d in zip(o["peak_staged"], o["depth"]) if d),
        transfer_s=transfer_s,
        place_s=_median([p for p, n in zip(places, f["place.count"]) if n]),
        stage_s=stage_s,
        compute_s=_median([c for c in f["compute.fwd_bwd_median_s"] if c is not None]),
        microbatch_bytes=_median([b / n for b, n in zip(f["place.bytes"], f["place.count"])
                                  if n]))

  def figure(self, name: str, values: Sequence[float]) -> Figure:
    """`values`' mean over the window, and the steps where it was a significant part."""
    held = sum(analysis.significant(v, s) for v, s in zip(values, self.step_s))
    return Figure(name, math.fsum(values) / len(values), held, len(values))

  def counts(self, figure: Figure) -> bool:
    return figure.steps >= max(1, STEP_SHARE * figure.of)

  @property
  def wire_is_the_bound(self) -> bool:
    """A micro-batch takes as long to cross as to compute: staging cannot keep up."""
    return (self.transfer_s is not None and self.compute_s is not None
            and self.transfer_s >= self.compute_s)

  def wire_why(self) -> str:
    """What the figures say where the wire is the bound."""
    return (f"the wire is the bound: a micro-batch takes {self.transfer_s:.2f} s to cross "
            f"against {self.compute_s:.2f} s of compute, so no depth beyond {self.wire_depth} "
            "can hide it")

  @property
  def wire_depth(self) -> int:
    """Where the wire is the bound, the depth that keeps it busy: the stages (a crossing and its
    placement, medians) one crossing spans; no deeper depth can help."""
    if not self.wire_is_the_bound or not self.transfer_s:
      return 1
    return _spans((self.transfer_s + (self.place_s or 0.0)) / self.transfer_s)


def advise(window: Window | None) -> list[Advice]:
  """The rule (docs/observability.md "Reading the figures"): which setting held staging back in
  `window`, to what, the figure that decided it and its cost; [] when nothing did."""
  if window is None:
    return []
  out = []
  s, size = window.settings, _size(window.microbatch_bytes)
  pool = window.figure("receive-pool wait", window.pool_wait_s)
  mid = window.figure("input wait mid-step", window.mid_step_s)
  boundary = window.figure("input wait at the boundary", window.boundary_s)
  # A transfer waiting for a receive buffer costs the step only where the trainer then waited
  # for its input (or the transfer ran out of its wait and fell back inline).
  if window.counts(pool) and (window.counts(mid) or window.counts(boundary)) or window.over_bound:
    out.append(Advice(HOST_BOUND, f"TUNIX_STAGE_MAX_HOST_BATCHES={s.max_host_batches + 1}", pool,
                      f"one more receive buffer on the trainer: {size} of host memory",
                      f"the trainer's receive pool held transfers back ({window.over_bound} ran "
                      "out of their wait)", Change(max_host_batches=s.max_host_batches + 1)))
  if any(window.refused):
    refused = Figure("stages refused", sum(window.refused), sum(map(bool, window.refused)),
                     len(window.refused), unit="")
    out.append(Advice(DEVICE_BOUND, f"TUNIX_STAGE_MAX_DEVICE_BATCHES={s.max_device_batches + 1}",
                      refused, f"{size} of device memory",
                      "a bound on the trainer was full",
                      Change(max_device_batches=s.max_device_batches + 1)))
  wire_steps = window.bound_by.count(analysis.WIRE)
  deeper_helps = not window.wire_is_the_bound or s.depth < window.wire_depth
  if window.counts(mid) and deeper_helps and window.depth_full:
    depth = s.depth + 1
    device = max(s.max_device_batches, depth)
    out.append(Advice(DEPTH, f"TUNIX_MAX_STAGED_BATCHES={depth} with "
                      f"TUNIX_STAGE_MAX_DEVICE_BATCHES={device}", mid,
                      f"{size} of device memory per micro-batch more",
                      f"the trainer waited mid-step with {s.depth} micro-batch(es) staged ahead",
                      Change(depth=depth, max_device_batches=device)))
  if window.counts(boundary) and s.prestage is False:
    depth = max(2, s.depth)
    knob = PRESTAGE_KNOBS.get(s.host, PRESTAGE_KNOBS["tunix"]).format(depth=depth)
    cost = (f"{size} of device memory per micro-batch more" if depth > s.depth else
            "no more memory (the next step's first micro-batches take the depth's slots)")
    out.append(Advice(PRESTAGE, knob, boundary, cost, "nothing was staged across the step boundary",
                      Change(prestage=True, depth=depth if s.host == "embedded" else None)))
  if wire_steps >= max(1, STEP_SHARE * len(window.step_s)):
    waits = mid if mid.value >= boundary.value else boundary
    why = "the trainer waited for its input: a faster wire shortens the wait"
    if window.wire_is_the_bound:
      why = window.wire_why()
    out.append(Advice(WIRE, "compress the payload (TUNIX_STAGE_CODEC=on, if its arrays "
                      "compress) or give the link more bandwidth", waits,
                      "no more memory (the codec's buffers aside)", why,
                      Change(wire=0.5)))
  cores = Figure("steps bound by shared cores", window.bound_by.count(analysis.SHARED_CORES),
                 window.bound_by.count(analysis.SHARED_CORES), len(window.bound_by), unit="")
  if cores.steps > cores.of // 2:
    out.append(Advice(CORES, "give the trainer's host more cores for its receive", cores,
                      "nothing in memory", "the compute runs slower while the receive runs "
                      "beside it on the same cores (nothing staging can change)", None))
  return out


def choose_depth(window: Window | None, most: int) -> tuple[int, str, bool]:
  """The depth the rule asks for the next step, at most `most` (a memory budget's), why, and
  whether the trainer was seen to need it: one deeper than the window ran at where the trainer
  still waited mid-step with that depth used up and the wire keeps up (`advise`'s DEPTH); else
  the stages a compute spans, with a cushion for a stage SPIKE times the longest step's mean (so
  a wire that keeps up only just gets a cushion, and one far faster than the compute holds one
  micro-batch, never more staged unused); where the wire is the bound, the depth that keeps it
  busy (`Window.wire_depth`: no deeper one can help)."""
  if window is None or window.stage_s is None or not window.compute_s:
    return 1, "no step measured yet", False
  found = {a.kind: a for a in advise(window)}
  if window.wire_is_the_bound:
    return min(most, window.wire_depth), window.wire_why(), False
  if DEPTH in found:
    return min(most, window.settings.depth + 1), str(found[DEPTH].figure), True
  want = _spans(SPIKE * window.stage_s / window.compute_s)
  return min(most, want), (f"a micro-batch's stage {window.stage_s:.2f} s against "
                           f"{window.compute_s:.2f} s of compute, {SPIKE:g}x spikes included, "
                           f"over the last {len(window.step_s)} step(s)"), False


def _spans(ratio: float) -> int:
  """How many of one thing a time `ratio` of it spans, a part under analysis.SHARE of one not
  counted (a placement of 2 % of a crossing does not ask for a second staged micro-batch)."""
  return max(1, math.ceil(ratio - analysis.SHARE))


def _median(values: list[float]) -> float | None:
  return statistics.median(values) if values else None


def _per(seconds: float, count: int) -> float:
  """A step's receives' or placements' mean time (0 where it had none)."""
  return seconds / count if count else 0.0


def _size(nbytes: float | None) -> str:
  return f"{nbytes / MIB:.0f} MiB" if nbytes else "one micro-batch"
