"""What to change in a job: the one rule that reads a window of its step figures and names the
setting that held staging back, to what, the figure that decided it and what it costs. `tunix-stage
report` asks it of a run's table (checked against the simulator where the lab is installed), and a
pipeline that sizes itself (core/sizing.py, at auto) of its last steps' live figures: both give
`Window.of` the figures by their names (core/telemetry/figures.py). docs/observability.md
"Reading the figures".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core.telemetry import figures as figures_lib

# A cause counts once it held at least this share of the window's steps (and one step): a cause
# in a minority of the steps still costs time, and the simulator judges whether a change helps.
STEP_SHARE = 0.25
# The depth a self-sizing pipeline keeps is the stages a compute spans, with a cushion for a stage
# this many times its recent length (the upstream change's production measurements: 2x transient
# gRPC contention spikes).
SPIKE = 2.0

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


Table = Mapping[str, Sequence[Any]]
"""A side's step figures by name (figures.FIGURES), each a value per step."""


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
  def of(cls, settings: Settings, trainer: Table, orchestrator: Table, *,
         first_alone: bool = False) -> "Window | None":
    """The window of a job's steps, each side's figures by name (figures.FIGURES: a run's
    DataFrame, or a few live steps' values; a figure not known in a step is None or NaN): the
    trainer steps but a process's first (which compiles and has no step before it: a report
    never advises on it; with `first_alone`, a sizer that has seen no other reads it) that
    staged, where there are any (an inline step's wait says nothing of a staging setting); None
    with no such trainer step."""
    f = {name: np.asarray(trainer[name], dtype=np.float64) for name in (
        "step_s", "compute_s", "input_wait_mid_step_s", "input_wait_boundary_s", "other_s",
        "received", "received_s", "placed", "placed_s", "placed_bytes", "placed_staged",
        "pool_wait_s", "pool_over_bound", "fwd_bwd_median_s")}
    rows = ~np.isnan(f["step_s"])
    if not rows.any():
      if not first_alone or not len(rows):
        return None
      rows = np.ones(len(rows), dtype=bool)
    staged = rows & (f["placed_staged"] > 0)
    rows = staged if staged.any() else rows
    f = {name: values[rows] for name, values in f.items()}
    bound = tuple(np.asarray(trainer["bound_by"], dtype=object)[rows])
    o = {name: np.asarray(orchestrator[name], dtype=np.float64) for name in (
        "depth", "peak_staged", "stage_call_median_s", "stage_call_max_s",
        f"fallbacks_{contract.StageStatus.REFUSED.value}")}
    receives = figures_lib.each(f["received_s"], f["received"])
    places = figures_lib.each(f["placed_s"], f["placed"])
    # A micro-batch's crossing: its receive on the trainer; where the trainer timed none (tunix's
    # own unary call is received before any hook sees it), the orchestrator's stage call.
    if (f["received"] > 0).any():
      transfer_s = figures_lib.median(receives[f["received"] > 0])
      stage_s = float(np.max(receives + places))
    else:
      transfer_s = figures_lib.median(o["stage_call_median_s"])
      stage_s = _max(o["stage_call_max_s"])
    depth, peak = o["depth"], o["peak_staged"]
    return cls(
        settings=settings,
        step_s=np.where(np.isnan(f["step_s"]), f["compute_s"] + f["input_wait_mid_step_s"]
                        + np.nan_to_num(f["input_wait_boundary_s"]) + f["other_s"], f["step_s"]),
        mid_step_s=f["input_wait_mid_step_s"],
        boundary_s=np.nan_to_num(f["input_wait_boundary_s"]),
        pool_wait_s=f["pool_wait_s"],
        over_bound=int(f["pool_over_bound"].sum()),
        bound_by=bound,
        refused=tuple(int(n) for n in o[f"fallbacks_{contract.StageStatus.REFUSED.value}"]),
        depth_full=bool(len(depth)) and bool(np.all((peak >= depth) | (depth == 0))),
        transfer_s=transfer_s,
        place_s=figures_lib.median(places[f["placed"] > 0]),
        stage_s=stage_s,
        compute_s=figures_lib.median(f["fwd_bwd_median_s"]),
        microbatch_bytes=figures_lib.median(
            figures_lib.each(f["placed_bytes"], f["placed"])[f["placed"] > 0]))

  def figure(self, name: str, values: Sequence[float]) -> Figure:
    """`values`' mean over the window, and the steps where it was a significant part."""
    held = int(sum(figures_lib.significant(v, s) for v, s in zip(values, self.step_s)))
    return Figure(name, math.fsum(values) / len(values), held, len(values))

  def counts(self, figure: Figure) -> bool:
    return figure.steps >= max(1, STEP_SHARE * figure.of)

  @property
  def wire_is_the_bound(self) -> bool:
    """A micro-batch takes as long to cross as to compute (figures.wire_bound)."""
    return figures_lib.wire_bound(self.transfer_s, self.compute_s,
                                  figures_lib.median(self.step_s))

  def wire_why(self, auto: bool = False) -> str:
    """What the figures say where the wire is the bound. At `auto` (a depth sized each step,
    which climbs past wire_depth on a mid-step wait), what a deeper depth does there."""
    said = (f"the wire is the bound: a micro-batch takes {self.transfer_s:.2f} s to cross "
            f"against {self.compute_s:.2f} s of compute, so ")
    if auto:
      return said + (f"depth {self.wire_depth} keeps the wire busy, and the deeper depths auto "
                     "climbs to ride out its spikes but cannot hide it")
    return said + f"no depth beyond {self.wire_depth} can hide it"

  @property
  def wire_depth(self) -> int:
    """Where the wire is the bound, the depth that keeps it busy: the stages (a crossing and its
    placement, medians) one crossing spans; no deeper depth can help."""
    if not self.wire_is_the_bound or not self.transfer_s:
      return 1
    return _spans((self.transfer_s + (self.place_s or 0.0)) / self.transfer_s)


def advise(window: Window | None, *, auto: bool = False) -> list[Advice]:
  """The rule (docs/observability.md "Reading the figures"): which setting held staging back in
  `window`, to what, the figure that decided it and its cost; [] when nothing did. `auto`: the
  window's depth was sized each step (its wording says so)."""
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
  wire_steps = window.bound_by.count(figures_lib.WIRE)
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
      why = window.wire_why(auto)
    out.append(Advice(WIRE, "compress the payload (TUNIX_STAGE_CODEC=on, if its arrays "
                      "compress) or give the link more bandwidth", waits,
                      "no more memory (the codec's buffers aside)", why,
                      Change(wire=0.5)))
  cores = Figure("steps bound by shared cores", window.bound_by.count(figures_lib.SHARED_CORES),
                 window.bound_by.count(figures_lib.SHARED_CORES), len(window.bound_by), unit="")
  if cores.steps > cores.of // 2:
    out.append(Advice(CORES, "give the trainer's host more cores for its receive", cores,
                      "nothing in memory", "the compute runs slower while the receive runs "
                      "beside it on the same cores (nothing staging can change)", None))
  return out


def choose_depth(window: Window | None, most: int, depth: int = 1) -> tuple[int, str, bool]:
  """The depth the rule asks for the next step, from `depth` (the one in force), at most `most`
  (a memory budget's), why, and whether the trainer was seen to need it. It moves only on a
  measured step's evidence: one deeper where the trainer waited mid-step with the window's depth
  used up (where the wire is the bound too: a deeper cushion rides out its spikes, and a depth
  the wire cannot fill is never used up, which ends the climb), and deeper only so; else the
  stages a compute spans, with a cushion for a stage SPIKE times the longest step's mean (where
  the wire is the bound, the depth that keeps it busy, `Window.wire_depth`), where that is
  shallower than `depth` and the trainer did not wait mid-step (a micro-batch staged ahead that
  sits unused); `depth` kept otherwise."""
  if window is None or window.stage_s is None or not window.compute_s:
    return min(most, depth), "no step measured yet", False
  mid = window.figure("input wait mid-step", window.mid_step_s)
  if window.counts(mid) and window.depth_full:
    return min(most, window.settings.depth + 1), str(mid), True
  if window.wire_is_the_bound:
    want, why = window.wire_depth, window.wire_why()
  else:
    want = _spans(SPIKE * window.stage_s / window.compute_s)
    why = (f"a micro-batch's stage {window.stage_s:.2f} s against {window.compute_s:.2f} s of "
           f"compute, {SPIKE:g}x spikes included, over the last {len(window.step_s)} step(s)")
  if want < depth and window.counts(mid):
    return min(most, depth), f"kept: {mid}, with the depth not used up", False
  if want > depth:  # deeper only on a measured wait (above)
    return min(most, depth), f"kept: no mid-step wait with the depth used up ({why})", False
  return min(most, want), why, False


def _spans(ratio: float) -> int:
  """How many of one thing a time `ratio` of it spans, a part under figures.SHARE of one not
  counted (a placement of 2 % of a crossing does not ask for a second staged micro-batch)."""
  return max(1, math.ceil(ratio - figures_lib.SHARE))


def _max(values: np.ndarray) -> float | None:
  values = values[~np.isnan(values)]
  return float(np.max(values)) if len(values) else None


def _size(nbytes: float | None) -> str:
  return figures_lib.size(nbytes) if nbytes else "one micro-batch"
