"""The orchestrator's stage-ahead depth at auto (TUNIX_MAX_STAGED_BATCHES=auto): a small numeric
controller over numbers the steps already measured, within a memory budget in bytes that the
staged micro-batches never exceed. `Sizer` (run in a job by `AutoDepth`) reads the trainer's
newest closed step as it rides on each stage answer (core.contract.TrainerStep) and its own steps
(`OrchestratorStep`). The trainer's host bound: core/host_bound.py. Loaded only where the depth is
auto. docs/configuration.md "Staging that sizes itself", docs/simulate.md "auto".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
from typing import Any, Iterable, Sequence

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import host_bound
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import figures as figures_lib

log = logging.getLogger("tunix_stage_plugin")
DEFAULT_DEPTH = config_lib.SETTINGS_BY_FIELD["max_staged_batches"].fixed  # where auto starts
WINDOW, STEP_SHARE, MIB = host_bound.WINDOW, host_bound.STEP_SHARE, host_bound.MIB
Wait, over_budget = host_bound.Wait, host_bound.over_budget
SPIKE = 2.0  # the cushion: a stage this many times its recent length (2x gRPC contention spikes)
TRIAL = 2  # the steps a deeper depth is measured at before it is kept
CEILING_STEPS = 8  # the trainer steps a depth that did not pay is not tried again


@dataclasses.dataclass(frozen=True)
class Choice:
  step: int
  depth: int
  reason: str  # "depth 2: <the numbers that decided>; budget 6.0 GiB, 4.2 used"
  asked: tuple[int, str] | None = None  # the depth the rule asked and why, before the budget


@dataclasses.dataclass(frozen=True)
class OrchestratorStep:
  """An orchestrator's step in numbers: the depth it ran at, the most micro-batches it held
  staged or staging at once, and its stage calls' latency (median and longest; None where it
  timed none)."""

  step: int
  depth: int
  peak_staged: int
  stage_call_s: float | None = None
  stage_call_max_s: float | None = None

  @classmethod
  def of(cls, report: Any, depth: int, stage_calls: Sequence[float] = ()) -> "OrchestratorStep":
    """From a step's core.pipeline.StepReport, its depth and its stage calls' seconds."""
    return cls(report.step, depth, report.peak_staged,
               statistics.median(stage_calls) if stage_calls else None,
               max(stage_calls) if stage_calls else None)


def _step_s(t: contract.TrainerStep) -> float:
  """A step's time; a first step's (none before it): its parts."""
  if t.step_s is not None:
    return t.step_s
  return t.compute_s + t.mid_step_wait_s + (t.boundary_wait_s or 0.0) + t.other_s


def _each(total: float, count: int) -> float:
  return total / count if count else 0.0


def _spans(ratio: float) -> int:
  """How many of one thing a time `ratio` of it spans, a part under figures.SHARE of one not
  counted (a placement of 2 % of a crossing does not ask for a second staged micro-batch)."""
  return max(1, math.ceil(ratio - figures_lib.SHARE))


def _median(values: Iterable[float | None]) -> float | None:
  known = [v for v in values if v is not None]
  return statistics.median(known) if known else None


@dataclasses.dataclass(frozen=True)
class Window:
  """The numbers the depth's rule reads over its last steps at the depth in force (the
  trainer's, and the orchestrator's `used_up`)."""

  step_s: float  # T, a step's time (mean)
  wait: Wait  # W, the trainer's mid-step input wait
  gain_s: float  # G = mean of min(W, T - B): what one more staged micro-batch can remove
  transfer_s: float | None  # R, a micro-batch's crossing (median)
  place_s: float  # P, its placement (median)
  stage_s: float | None  # S, its crossing and placement, the longest step's mean
  compute_s: float | None  # C, a micro-batch's compute (median)
  used_up: bool  # every step held its depth's micro-batches staged or staging at once

  @classmethod
  def of(cls, trainer: Sequence[contract.TrainerStep],
         orchestrator: Sequence[OrchestratorStep]) -> "Window | None":
    """Over the trainer steps that staged, where there are any (an inline step's wait says
    nothing of a depth); None with no trainer step. Where the trainer timed no receive (tunix's
    own call is received before any hook sees it), the orchestrator's stage calls stand for R
    and S."""
    if not trainer:
      return None
    trainer = [t for t in trainer if t.staged] or list(trainer)
    steps_s = [_step_s(t) for t in trainer]
    receives = [_each(t.received_s, t.received) for t in trainer]
    places = [_each(t.placed_s, t.placed) for t in trainer]
    if any(t.received for t in trainer):
      transfer = _median(r for r, t in zip(receives, trainer) if t.received)
      stage = max(r + p for r, p in zip(receives, places))
    else:
      transfer = _median(o.stage_call_s for o in orchestrator)
      stage = max((o.stage_call_max_s for o in orchestrator if o.stage_call_max_s is not None),
                  default=None)
    # B: the stage path's busier part over the step's micro-batches (the wire's receives or the
    # placements, each at its mean over the window: a receive ends in one step or the next).
    received = sum(t.received for t in trainer)
    each = max(_each(math.fsum(t.received_s for t in trainer), received) if received
               else transfer or 0.0,
               _each(math.fsum(t.placed_s for t in trainer), sum(t.placed for t in trainer)))
    busy = [each * t.microbatches for t in trainer]
    waits = [t.mid_step_wait_s for t in trainer]
    gains = [max(0.0, min(w, s - b)) for w, s, b in zip(waits, steps_s, busy)]
    return cls(step_s=math.fsum(steps_s) / len(steps_s),
               wait=Wait.over("input wait mid-step", waits, steps_s),
               gain_s=math.fsum(gains) / len(gains), transfer_s=transfer,
               place_s=_median(p for p, t in zip(places, trainer) if t.placed) or 0.0,
               stage_s=stage, compute_s=_median(t.fwd_bwd_s for t in trainer),
               used_up=bool(orchestrator) and all(o.peak_staged >= o.depth
                                                  for o in orchestrator))

  @property
  def pays(self) -> bool:
    """One more staged micro-batch can remove a significant part of the step."""
    return figures_lib.significant(self.gain_s, self.step_s)

  @property
  def wire_is_the_bound(self) -> bool:
    """A micro-batch takes as long to cross as to compute (figures.wire_bound)."""
    return figures_lib.wire_bound(self.transfer_s, self.compute_s, self.step_s)

  @property
  def noise(self) -> bool:
    """A micro-batch's stage and compute are both under the noise floor (figures.significant):
    they say nothing of a depth."""
    return not figures_lib.significant(max(self.stage_s, self.compute_s), self.step_s)

  def cushion(self) -> tuple[int, str]:
    """The depth that hides a stage, and why: where the wire is the bound, the depth that keeps
    it busy (the stages one crossing spans); else the stages a compute spans, a stage SPIKE
    times the longest step's mean."""
    if self.wire_is_the_bound:
      want = _spans((self.transfer_s + self.place_s) / self.transfer_s) if self.transfer_s else 1
      crossing = (f"a micro-batch takes {self.transfer_s:.2f} s to cross against "
                  f"{self.compute_s:.2f} s of compute")
      if self.wait.counts:  # the trainer's steps were bound by their input wait too
        return want, f"the wire is the bound: {crossing}, so no depth beyond {want} can hide it"
      return want, f"{crossing}: depth {want} keeps the wire busy"
    return _spans(SPIKE * self.stage_s / self.compute_s), (
        f"a micro-batch's stage {self.stage_s:.2f} s against {self.compute_s:.2f} s of compute, "
        f"{SPIKE:g}x spikes included, over the last {self.wait.of} step(s)")


@dataclasses.dataclass(frozen=True)
class _Trial:
  depth: int  # the depth tried (one deeper than the one before)
  why: str


class Sizer:
  """The stage-ahead depth, a numeric controller. Told the trainer's newest closed steps
  (`trainer`, as they ride on stage answers) and the orchestrator's own (`orchestrator`); the
  pipeline asks it each step's depth (`depth_for`) and, as it goes, the most micro-batches the
  budget holds (`most`). Its rule, over the last WINDOW trainer steps run at the depth d in force
  (T a step's time, W its mid-step input wait, B its micro-batches' time on the stage path's
  busier part, receives or placements; R, P, S, C a micro-batch's crossing, placement, both,
  compute):

    G = mean(min(W, T - B))   the wait one more staged micro-batch can remove: at most the wait,
                              at most the time the stage path stood idle
    d + 1   where W counts (significant in STEP_SHARE of the steps), every step held d staged
            ahead, and G >= figures.SHARE x T (it pays for its memory), unless d + 1 is a
            ceiling; then kept (a floor) once the orchestrator held d + 1 at once in one of its
            next TRIAL steps, else back to d with d + 1 a ceiling for CEILING_STEPS steps (the
            stages cannot run further ahead)
    want    where W does not count: ceil(SPIKE x S / C - SHARE), the stages a compute spans,
            spikes included (where R >= C, the wire the bound: ceil((R + P) / R - SHARE), the
            depth that keeps it busy); taken where shallower than d, never below the floor
    d       otherwise
    then    at most what the trainer holds, and depth x a micro-batch's bytes <= the budget
            (depth 1 where one micro-batch alone exceeds it, said once).

  It starts at the fixed default depth; a change restarts the window (the trainer step in flight
  at the change ran at the depth before). A micro-batch's bytes are given (the simulator's) or
  learned: the most this process sent (`sent`) or the trainer placed."""

  def __init__(self, *, budget_bytes: int, microbatch_bytes: int | None = None,
               window: int = WINDOW) -> None:
    if microbatch_bytes is not None and (budget_bytes < microbatch_bytes or microbatch_bytes < 1):
      raise ValueError(f"a budget of {budget_bytes} bytes holds no micro-batch of "
                       f"{microbatch_bytes} bytes")
    self.budget_bytes, self.microbatch_bytes = budget_bytes, microbatch_bytes
    self._trainer: collections.deque[contract.TrainerStep] = collections.deque(maxlen=window)
    self._first: contract.TrainerStep | None = None  # a first step, read where no other is
    self._orchestrator: collections.deque[OrchestratorStep] = collections.deque(maxlen=window)
    self._newest: tuple[str, int] | None = None  # the trainer step last read (run, step)
    self._since = 0  # the trainer steps read from (after a change: those run at the new depth)
    self._holds: int | None = None  # what the trainer can hold staged; None before it says
    self.depth = DEFAULT_DEPTH  # the depth in force
    self._floor, self._floor_why = 1, ""  # the deepest depth that paid
    self._trial: _Trial | None = None
    self._ceiling: tuple[int, int] | None = None  # a depth that did not pay, steps left
    self._placed = 0  # the largest micro-batch the trainer placed, bytes
    self.sent = 0  # the largest micro-batch this process sent, bytes
    self._over = False  # one micro-batch alone exceeds the budget (said once)
    # The last few steps' choices: a step's depth is chosen before the step before it ends.
    self.choices: collections.deque[Choice] = collections.deque(maxlen=4)

  @property
  def most(self) -> int | None:
    """The deepest depth the budget holds (at least 1); None while a micro-batch's bytes are not
    known."""
    nbytes = self._microbatch_bytes()
    return None if nbytes is None else max(1, self.budget_bytes // nbytes)

  def _microbatch_bytes(self) -> int | None:
    if self.microbatch_bytes is not None:
      return self.microbatch_bytes
    return max(self._placed, self.sent) or None

  def trainer(self, step: contract.TrainerStep) -> None:
    """The trainer's newest closed step, as a stage answer brought it (read once)."""
    if self._newest is not None and step.run == self._newest[0] and step.step <= self._newest[1]:
      return  # read already, or older than one read
    if self._newest is None or step.run != self._newest[0]:  # a new run of the trainer
      self._trainer.clear()
      self._first, self._since = None, 0
    self._newest = (step.run, step.step)
    self._holds = step.holds
    if step.placed:
      self._placed = max(self._placed, max(1, step.placed_bytes // step.placed))
    if self._ceiling is not None:
      self._ceiling = None if self._ceiling[1] <= 1 else (self._ceiling[0], self._ceiling[1] - 1)
    if step.step < self._since:
      return  # it ran at the depth before
    if step.step_s is None:
      self._first = step
    else:
      self._trainer.append(step)

  def orchestrator(self, step: OrchestratorStep) -> None:
    """One of the orchestrator's own steps, as it ended."""
    self._orchestrator.append(step)

  def window(self) -> Window | None:
    """The rule's numbers over the last steps at the depth in force (a first step, which
    compiles, alone only where no other was read)."""
    trainer = list(self._trainer) or ([self._first] if self._first is not None else [])
    return Window.of(trainer, [o for o in self._orchestrator if o.depth == self.depth])

  def depth_for(self, step: int, depth: int) -> int:  # pylint: disable=unused-argument
    """The pipeline's seam: `step`'s depth (`depth`, the configured one, is not used)."""
    before = self.depth
    chosen, why, trial = self._rule(self.window())
    if self._holds is not None and chosen > self._holds:
      chosen, why, trial = self._holds, f"what the trainer holds (depth {chosen} asked: {why})", None
    choice = self.within_budget(step, chosen, why)
    if trial is not None and choice.depth == chosen:  # (not where the budget cut it)
      self._trial = trial
    self.depth = choice.depth
    self.choices.append(choice)
    if self.depth != before:  # the window restarts: the step in flight ran at the depth before
      self._trainer.clear()
      self._first = None
      self._since = 0 if self._newest is None else self._newest[1] + 2
    return self.depth

  def _rule(self, w: Window | None) -> tuple[int, str, _Trial | None]:
    """The depth the rule asks from the depth in force, why, and the trial it starts."""
    d = self.depth
    if self._trial is not None and self._trial.depth != d:  # the budget or the host cut it
      self._trial = None
    if self._trial is not None:
      trial, ran = self._trial, [o for o in self._orchestrator if o.depth == d]
      if len(ran) < TRIAL:
        return d, f"trying it: {trial.why}", None
      self._trial = None
      if any(o.peak_staged >= d for o in ran):
        self._floor, self._floor_why = d, trial.why
      else:
        self._ceiling = (d, CEILING_STEPS)
        return d - 1, (f"depth {d} was never filled in {len(ran)} steps (the stages cannot run "
                       f"further ahead), not tried again for {CEILING_STEPS} steps"), None
    if w is None or w.stage_s is None or not w.compute_s:
      if self._newest is None:
        return d, "the default (no step measured yet)", None
      return d, f"kept: no step measured at depth {d} yet", None
    if w.wait.counts and w.used_up:
      if not w.pays:
        return d, (f"kept: {w.wait}, {w.gain_s:.2f} s of it with the stages idle, too little "
                   "for one more"), None
      if self._ceiling is not None and d + 1 >= self._ceiling[0]:
        return d, f"kept: depth {self._ceiling[0]} was never filled ({w.wait})", None
      return d + 1, str(w.wait), _Trial(d + 1, str(w.wait))
    if w.noise:
      return d, (f"kept: a micro-batch's stage ({w.stage_s:.2f} s) and compute "
                 f"({w.compute_s:.2f} s) are under the noise floor (each under "
                 f"{figures_lib.FLOOR_S:g} s or {figures_lib.SHARE:.0%} of a step)"), None
    want, why = w.cushion()
    if want < d and w.wait.counts:
      return d, f"kept: {w.wait}, with the depth not used up", None
    if want > d:  # deeper only on a measured wait (above)
      return d, f"kept: no mid-step wait with the depth used up ({why})", None
    if want < self._floor:
      return self._floor, f"kept: the trainer waited with a depth less ({self._floor_why})", None
    return want, why, None

  def within_budget(self, step: int, chosen: int, why: str) -> Choice:
    """The choice of `chosen` for `step` (and why) as the budget lets it be held."""
    asked, nbytes, most = (chosen, why), self._microbatch_bytes(), self.most
    if nbytes is not None and nbytes > self.budget_bytes:
      chosen, why = 1, over_budget(nbytes, self.budget_bytes, not self._over, "depth 1")
      self._over = True
    elif most is not None and chosen > most:
      chosen, why = most, f"the budget decided (depth {chosen} asked: {why})"
    used = "a micro-batch's size not known yet" if nbytes is None else (
        f"{self._size(chosen * nbytes)} used")
    return Choice(step, chosen, f"depth {chosen}: {why}; budget {self._size(self.budget_bytes)}, "
                  f"{used}", asked)

  def held(self, step: int) -> Choice:
    """`step`'s choice as the budget let it be held: a micro-batch's bytes learned during the
    step (its first one sent) may have cut it."""
    choice = next(c for c in reversed(self.choices) if c.step == step)
    capped = choice if choice.asked is None else self.within_budget(step, *choice.asked)
    if capped.depth >= choice.depth:
      return choice
    self.depth = min(self.depth, capped.depth)
    return capped

  def _size(self, nbytes: int) -> str:
    if self.microbatch_bytes == 1:  # a budget counted in micro-batches (the simulator's)
      return f"{nbytes} micro-batch{'' if nbytes == 1 else 'es'}"
    return figures_lib.size(nbytes)


class AutoDepth:
  """A job's depth at auto (the orchestrator's): a Sizer told the trainer's newest closed step
  as each stage answer brings it (`answered`, the host's stage call) and each of its own steps as
  it ends (`step_ended`). A trainer that can never stage (a stage answered UNSUPPORTED: no step
  numbers will come): the fixed default depth from then on, said once. A recorder sink of the
  process's telemetry: the micro-batches it sends size the budget's room (`room`, the
  pipeline's) from the first one sent, and its stage calls' times stand for a crossing where the
  trainer times none."""

  def __init__(self, budget_bytes: int, telemetry: Any) -> None:
    self.sizer = Sizer(budget_bytes=budget_bytes)
    self._telemetry = telemetry
    self._calls: dict[int, list[float]] = collections.defaultdict(list)  # stage calls by step
    self.without: str | None = None  # why no step numbers come: the default depth
    telemetry.recorder.add_sink(self)

  def room(self) -> int | None:
    """The pipeline's: the most micro-batches staged ahead at once now (the budget's)."""
    return self.sizer.most

  def record(self, span: Any) -> None:  # what this process sends, and its stage calls
    if span.track == tracks.ORCHESTRATOR_SEND:
      self.sizer.sent = max(self.sizer.sent, dict(span.args).get("bytes") or 0)
    elif span.track == tracks.ORCHESTRATOR_STAGE:
      step = dict(span.args).get("step")
      if step is not None:
        # Not span.duration: a sink calls nothing back in the recorder that tells it.
        self._calls[step].append(span.end - span.start)

  def answered(self, stage: contract.StageOutcome) -> None:
    """A stage call's answer: the trainer's newest closed step on it, or a trainer that can
    never stage."""
    if stage.trainer is not None:
      self.sizer.trainer(stage.trainer)
    elif stage.status is contract.StageStatus.UNSUPPORTED and self.without is None:
      self.without = stage.reason or "it cannot stage"
      log.warning("tunix-stage: TUNIX_MAX_STAGED_BATCHES=auto: the trainer sends no step "
                  "figures (%s); staging at the default depth %d from now on", self.without,
                  DEFAULT_DEPTH)

  def depth_for(self, step: int, depth: int) -> int:
    """The pipeline's seam (under the host's own, where it has one)."""
    if self.without is None:
      return self.sizer.depth_for(step, depth)
    self.sizer.choices.append(self.sizer.within_budget(
        step, DEFAULT_DEPTH, f"the default, the trainer sends no figures ({self.without})"))
    return self.sizer.choices[-1].depth

  def host_chose(self, step: int, depth: int, who: str) -> None:
    """The host's own seam gave `step` another depth than the one chosen: that one is said."""
    chosen = self.sizer.held(step)
    if depth != chosen.depth:
      self.sizer.choices.append(Choice(step, depth, f"depth {depth}: {who} (auto chose "
                                       f"{chosen.reason})"))

  def step_ended(self, report: Any) -> int:
    """A step ended (`report`, its core.pipeline.StepReport): its depth and why go in its record
    and line, and the sizer reads its numbers; returns the depth (0 for a step the pipeline
    asked no depth for: it staged nothing)."""
    calls = self._calls.pop(report.step, [])
    for older in [s for s in self._calls if s < report.step]:
      del self._calls[older]
    if not any(c.step == report.step for c in self.sizer.choices):
      return 0
    choice = self.sizer.held(report.step)
    self._telemetry.sized(figures_lib.ORCHESTRATOR, "max_staged_batches", choice.depth,
                          choice.reason)
    self.sizer.orchestrator(OrchestratorStep.of(report, choice.depth, calls))
    return choice.depth

  def close(self) -> None:
    self._telemetry.recorder.remove_sink(self)


