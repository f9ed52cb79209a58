"""Staging that sizes itself (TUNIX_MAX_STAGED_BATCHES=auto, TUNIX_STAGE_MAX_HOST_BATCHES=auto):
each step's stage-ahead depth (`Sizer`, the orchestrator's) and the trainer's host bound
(`HostBound`, a step sink of the trainer's) chosen by the one rule of what to change
(core/advice.py) from the last steps' figures as their step aggregators made them, within a
memory budget in bytes that the staged micro-batches never exceed. Loaded only where a depth or
bound is auto. docs/configuration.md "Staging that sizes itself", docs/simulate.md "auto".
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import Any, Awaitable, Callable, Iterable

from tunix_stage_plugin.core import advice
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import outcome
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import figures as figures_lib

log = logging.getLogger("tunix_stage_plugin")
TRAINER, ORCHESTRATOR = figures_lib.TRAINER, figures_lib.ORCHESTRATOR
WINDOW = 3  # the last steps a choice reads
QUIET_STEPS = 3  # steps without a transfer waiting for a buffer before the host bound shrinks
DEFAULT_DEPTH = config_lib.SETTINGS_BY_FIELD["max_staged_batches"].fixed  # where auto starts
MIB = figures_lib.MIB
RECEIVED = (("received_bytes", "received"), ("placed_bytes", "placed"))  # a trainer's bytes


@dataclasses.dataclass(frozen=True)
class Choice:
  step: int
  depth: int
  reason: str  # "depth 2: <the figure that decided>; budget 6.0 GiB, 4.2 used"
  asked: tuple[int, str] | None = None  # the depth the rule asked and why, before the budget


def _table(role: str, rows: Iterable[dict[str, Any]]) -> dict[str, list[Any]]:
  """Steps' figures by name (figures.row's), a value per step: what advice.Window.of reads."""
  rows = list(rows)
  return {name: [r[name] for r in rows] for name in figures_lib.BY_ROLE[role]}


def _per_microbatch(rows: Iterable[dict[str, Any]], *pairs: tuple[str, str]) -> int | None:
  """A micro-batch's bytes as the steps moved it (the largest seen): each pair's bytes figure
  over its count figure, in the steps that counted any."""
  sizes = [r[nbytes] / r[count] for r in rows for nbytes, count in pairs if r[count]]
  return max(1, int(max(sizes))) if sizes else None


class Sizer:
  """Feed it each step's figures (`observe`: the trainer's and the orchestrator's, as their step
  aggregators made them); the pipeline asks it each step's depth (`depth_for`) and, as it goes,
  the most micro-batches the budget holds (`most`). From the fixed default depth it moves only on
  a measured step's evidence (advice.choose_depth), never shallower than a depth the trainer was
  seen to need, at most what the trainer can hold (`holds`) and the budget (depth x micro-batch
  bytes; depth 1 where one micro-batch alone exceeds it, said once). A micro-batch's bytes are
  given (the simulator's) or learned: the most this process sent (`sent`) or the trainer placed."""

  def __init__(self, *, budget_bytes: int, microbatch_bytes: int | None = None,
               window: int = WINDOW, host: str = "tunix") -> None:
    if microbatch_bytes is not None and (budget_bytes < microbatch_bytes or microbatch_bytes < 1):
      raise ValueError(f"a budget of {budget_bytes} bytes holds no micro-batch of "
                       f"{microbatch_bytes} bytes")
    self.budget_bytes, self.microbatch_bytes = budget_bytes, microbatch_bytes
    self.host = host
    self._trainer: collections.deque[dict[str, Any]] = collections.deque(maxlen=window)
    self._orchestrator: collections.deque[dict[str, Any]] = collections.deque(maxlen=window)
    self._bounds = (config_lib.SETTINGS_BY_FIELD["max_device_batches"].default,
                    config_lib.SETTINGS_BY_FIELD["max_host_batches"].fixed)
    self._holds: int | None = None  # what the trainer can hold staged; None before it says
    self.depth = DEFAULT_DEPTH  # the depth in force
    self._floor, self._floor_why = 1, ""  # the deepest depth the trainer was seen to need
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
    placed = _per_microbatch(self._trainer, ("placed_bytes", "placed")) or 0
    return max(placed, self.sent) or None

  def observe(self, trainer: outcome.TrainerStep | None,
              orchestrator: dict[str, Any] | None) -> None:
    """One step's figures (either side may be missing in a step): the trainer's newest step
    with its bounds, the orchestrator's own step."""
    if trainer is not None:
      self._trainer.append(figures_lib.row(TRAINER, trainer.figures))
      self._bounds = (trainer.max_device_batches, trainer.max_host_batches)
      self._holds = trainer.holds
    if orchestrator is not None:
      self._orchestrator.append(figures_lib.row(ORCHESTRATOR, orchestrator))

  def window(self) -> advice.Window | None:
    """The rule's window over the last steps observed."""
    orchestrator = _table(ORCHESTRATOR, self._orchestrator)
    depth = orchestrator["depth"][-1] if self._orchestrator else self.depth
    settings = advice.Settings(
        host=self.host, depth=depth,
        prestage=any(orchestrator["prestaged"]) if self._orchestrator else None,
        max_device_batches=self._bounds[0], max_host_batches=self._bounds[1])
    return advice.Window.of(settings, _table(TRAINER, self._trainer), orchestrator,
                            first_alone=True)

  def depth_for(self, step: int, depth: int) -> int:  # pylint: disable=unused-argument
    """The pipeline's seam: `step`'s depth (`depth`, the configured one, is not used)."""
    window = self.window()
    chosen, why, needed = advice.choose_depth(window, config_lib.MAX_DEPTH, self.depth)
    why = why if window else f"the default ({why})"
    if needed and chosen > self._floor:
      self._floor, self._floor_why = chosen, why
    if chosen < self._floor:
      chosen, why = self._floor, f"kept: the trainer waited with a depth less ({self._floor_why})"
    if self._holds is not None and chosen > self._holds:
      chosen, why = self._holds, f"what the trainer holds (depth {chosen} asked: {why})"
    self.depth = chosen
    self.choices.append(self.within_budget(step, chosen, why))
    return self.depth

  def within_budget(self, step: int, chosen: int, why: str) -> Choice:
    """The choice of `chosen` for `step` (and why) as the budget lets it be held."""
    asked, nbytes, most = (chosen, why), self._microbatch_bytes(), self.most
    if nbytes is not None and nbytes > self.budget_bytes:
      chosen, why = 1, over_budget(nbytes, self.budget_bytes, not self._over, "depth 1")
      self._over = True
    elif most is not None and chosen > most:
      chosen, why = most, f"the budget decided (depth {chosen} asked: {why})"
    self.depth = min(self.depth, chosen)
    used = "a micro-batch's size not known yet" if nbytes is None else (
        f"{self._size(chosen * nbytes)} used")
    return Choice(step, chosen, f"depth {chosen}: {why}; budget {self._size(self.budget_bytes)}, "
                  f"{used}", asked)

  def held(self, step: int) -> Choice:
    """`step`'s choice as the budget let it be held: a micro-batch's bytes learned during the
    step (its first one sent) may have cut it."""
    choice = next(c for c in reversed(self.choices) if c.step == step)
    capped = choice if choice.asked is None else self.within_budget(step, *choice.asked)
    return choice if capped.depth == choice.depth else capped

  def _size(self, nbytes: int) -> str:
    if self.microbatch_bytes == 1:  # a budget counted in micro-batches (the simulator's)
      return f"{nbytes} micro-batch{'' if nbytes == 1 else 'es'}"
    return figures_lib.size(nbytes)


def over_budget(nbytes: int, budget: int, say: bool, least: str, count: int = 1) -> str:
  """Why staging holds `least`, the least that works: `count` micro-batches of `nbytes` exceed
  the budget; with `say` (one alone does), also a warning naming the setting to change."""
  if say:
    log.warning("tunix-stage: a micro-batch of %s alone exceeds TUNIX_STAGE_MEMORY_BUDGET (%s): "
                "staging holds the least that works (%s); set TUNIX_STAGE_MEMORY_BUDGET=%dMiB "
                "or more to let auto size it", figures_lib.size(nbytes),
                figures_lib.size(budget), least, -(-3 * nbytes // MIB))
  what = "a micro-batch" if count == 1 else f"{count} micro-batches"
  return (f"the budget decided: {what} of {figures_lib.size(nbytes)} exceed"
          f"{'s' if count == 1 else ''} it, so the least staging that works")


class NoFigures(RuntimeError):
  """The trainer can never send its figures (a trainer without stage_figures)."""


class AutoDepth:
  """A job's depth at auto (the orchestrator's): a Sizer fed each step with the orchestrator's own
  step figures and the trainer's newest step, asked by `fetch` (the trainer's stage_figures call)
  once per step after it, off the critical path (a task of its own; one at a time). A trainer
  that can never send them (`fetch` raises NoFigures): the fixed default depth from then on, said
  once. A recorder sink of the process's telemetry: the micro-batches it sends size the budget's
  room (`room`, the pipeline's), from the first one sent."""

  def __init__(self, budget_bytes: int,
               fetch: Callable[[], Awaitable[outcome.TrainerStep | None]], telemetry: Any,
               host: str) -> None:
    self.sizer = Sizer(budget_bytes=budget_bytes, host=host)
    self._fetch, self._telemetry = fetch, telemetry
    self._task: asyncio.Task | None = None
    self._seen: tuple[str, int] | None = None  # the trainer step last observed (run, step)
    self.without: str | None = None  # why the trainer sends no figures: the default depth
    telemetry.recorder.add_sink(self)

  def room(self) -> int | None:
    """The pipeline's: the most micro-batches staged ahead at once now (the budget's)."""
    return self.sizer.most

  def record(self, span: Any) -> None:  # what this process sends: a micro-batch's bytes
    if span.track == tracks.ORCHESTRATOR_SEND:
      self.sizer.sent = max(self.sizer.sent, dict(span.args).get("bytes") or 0)

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

  def before_record(self, step: int) -> int:
    """`step` ended: its depth and why go in its record and line; returns the depth."""
    if not any(c.step == step for c in self.sizer.choices):
      return 0  # a step the pipeline asked no depth for (it staged nothing)
    choice = self.sizer.held(step)
    self._telemetry.sized(ORCHESTRATOR, "max_staged_batches", choice.depth, choice.reason)
    return choice.depth

  def after_step(self, figures: dict[str, Any]) -> None:
    """The step's figures are made (`figures`, the orchestrator's): the sizer reads them, and
    the trainer is asked for its own."""
    self.sizer.observe(None, figures)
    if self.without is None and (self._task is None or self._task.done()):
      self._task = asyncio.ensure_future(self._ask())

  async def _ask(self) -> None:
    try:
      newest = await self._fetch()
    except NoFigures as e:
      self.without = str(e)
      log.warning("tunix-stage: TUNIX_MAX_STAGED_BATCHES=auto: the trainer sends no step "
                  "figures (%s); staging at the default depth %d from now on", e,
                  DEFAULT_DEPTH)
      return
    except Exception as e:  # pylint: disable=broad-except  (asked again after the next step)
      log.debug("tunix-stage: the trainer's figures were not read this step (%s: %s)",
                type(e).__name__, e)
      return
    if newest is not None and (newest.run, newest.step) != self._seen:
      self._seen = (newest.run, newest.step)
      self.sizer.observe(newest, None)

  async def close(self) -> None:
    self._telemetry.recorder.remove_sink(self)
    task, self._task = self._task, None
    if task is not None:
      task.cancel()
      await asyncio.gather(task, return_exceptions=True)


class HostBound:
  """The trainer's host bound, sized each step (a telemetry step sink of the trainer's: told each
  closed step's figures). One more receive buffer where the rule's HOST_BOUND holds over the last
  steps (transfers waited for one and the trainer then waited for its input, or ran out of their
  wait), while (device + host + 1) micro-batches fit the budget; one fewer after QUIET_STEPS steps
  in which no transfer waited for one, never below 1. `apply(bound, reason)` sets it (the stores'
  set_bounds and the receive pool's bound: a shrink only lowers it for later arrivals)."""

  def __init__(self, *, budget_bytes: int, device_bound: int, host: str,
               apply: Callable[[int, str], None], bound: int = 1) -> None:
    self.budget_bytes, self.host = budget_bytes, host
    self._apply = apply
    self._steps: collections.deque[dict[str, Any]] = collections.deque(maxlen=WINDOW)
    self.restart(device_bound, bound)

  def restart(self, device_bound: int, bound: int = 1) -> None:
    """A new run (the same trainer process): from `bound`, nothing measured."""
    self.device_bound, self.bound = device_bound, bound
    self._over = False  # one micro-batch alone exceeds the budget (said once a run)
    self._steps.clear()
    self._quiet = 0
    self.reason = (f"host bound {bound}: no step measured yet; budget "
                   f"{figures_lib.size(self.budget_bytes)}")

  def step(self, figures: dict[str, Any]) -> None:
    row = figures_lib.row(TRAINER, figures)
    nbytes = _per_microbatch([row, *self._steps], *RECEIVED)
    least = self.device_bound + 1  # the micro-batches a host bound of 1 lets the trainer hold
    if nbytes is not None and least * nbytes > self.budget_bytes:
      alone = nbytes > self.budget_bytes
      self._set(1, over_budget(nbytes, self.budget_bytes, alone and not self._over,
                               "host bound 1", 1 if alone else least), nbytes)
      self._over |= alone
      return
    if not figures_lib.known(row["step_s"]):  # a first step (it compiles; none before it)
      return
    self._steps.append(row)
    self._quiet = 0 if row["pool_waits"] else self._quiet + 1
    settings = advice.Settings(host=self.host, depth=1, prestage=None,
                               max_device_batches=self.device_bound, max_host_batches=self.bound)
    window = advice.Window.of(settings, _table(TRAINER, self._steps), _table(ORCHESTRATOR, ()))
    found = {a.kind: a for a in advice.advise(window)}
    nbytes = _per_microbatch(self._steps, *RECEIVED)
    fits = nbytes is not None and (self.device_bound + self.bound + 1) * nbytes <= self.budget_bytes
    if advice.HOST_BOUND in found and fits:
      self._set(self.bound + 1, f"{found[advice.HOST_BOUND].figure}", nbytes)
    elif advice.HOST_BOUND in found:
      self._set(self.bound, f"kept, one more receive buffer would exceed the budget "
                f"({found[advice.HOST_BOUND].figure})", nbytes)
    elif self._quiet >= QUIET_STEPS and self.bound > 1:
      self._set(self.bound - 1, f"no transfer waited for a buffer in {self._quiet} steps", nbytes)
    elif self._quiet:
      self._set(self.bound, f"no transfer waited for a buffer in {self._quiet} step(s)", nbytes)
    else:
      self._set(self.bound, "kept: transfers waited for a buffer, the trainer not for its input",
                nbytes)

  def _set(self, bound: int, why: str, nbytes: int | None) -> None:
    if bound != self.bound:
      self._steps.clear()  # the next choice reads the steps at the new bound only
      self._quiet = 0
    self.bound = bound
    self.reason = f"host bound {bound}: {why}; {self._budget(nbytes)}"
    self._apply(bound, self.reason)

  def _budget(self, nbytes: int | None) -> str:
    held = "" if nbytes is None else (
        f", {figures_lib.size((self.device_bound + self.bound) * nbytes)} used")
    return f"budget {figures_lib.size(self.budget_bytes)}{held}"
