"""The trainer's host bound at auto: how many received micro-batches may wait in host buffers,
sized each step from the trainer's own steps within the memory budget (`HostBound`). Also what
both sizers share: a wait over a window, a micro-batch's bytes, the budget's line. The depth:
core/sizing.py. docs/configuration.md "Staging that sizes itself".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, Callable, Iterable, Sequence

from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core.telemetry import figures as figures_lib

log = logging.getLogger("tunix_stage_plugin")
WINDOW = 3  # the last steps a choice reads
STEP_SHARE = 0.25  # a wait counts once it held in this share of the window's steps (and one)
QUIET_STEPS = 3  # steps without a transfer waiting for a buffer before the host bound shrinks
MIB = figures_lib.MIB


@dataclasses.dataclass(frozen=True)
class Wait:
  """A wait over a window's steps: its mean a step, and in how many steps it was a significant
  part of the step (figures.significant)."""

  name: str
  mean_s: float
  held: int
  of: int

  @classmethod
  def over(cls, name: str, values: Sequence[float], steps_s: Sequence[float]) -> "Wait":
    held = sum(figures_lib.significant(v, s) for v, s in zip(values, steps_s))
    return cls(name, math.fsum(values) / len(values), held, len(values))

  @property
  def counts(self) -> bool:
    return self.held >= max(1, STEP_SHARE * self.of)

  def __str__(self) -> str:
    return f"{self.name} {self.mean_s:.2f} s a step (in {self.held} of {self.of} steps)"


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


def microbatch_bytes(steps: Iterable[contract.TrainerStep]) -> int | None:
  """A micro-batch's bytes as the steps moved it (the largest seen): received or placed bytes
  over their count, in the steps that counted any."""
  sizes = [nbytes / count for t in steps
           for nbytes, count in ((t.received_bytes, t.received), (t.placed_bytes, t.placed))
           if count]
  return max(1, int(max(sizes))) if sizes else None


class HostBound:
  """The trainer's host bound, sized each step (a telemetry step sink of the trainer's: told each
  closed step's figures, read as a TrainerStep). Its rule, over the last WINDOW steps at the
  bound in force (those that staged, where any did):

    bound + 1   where the receive-pool wait counts (significant in STEP_SHARE of the steps) and
                so does the trainer's input wait, mid-step or at the boundary (a transfer waited
                for a buffer, then the trainer for its input), or a wait ran out; while
                (device + bound + 1) micro-batches fit the budget
    bound - 1   after QUIET_STEPS steps in which no transfer waited for a buffer, never below 1
    1           where (device + 1) micro-batches exceed the budget (said once where one alone
                does).

  `apply(bound, reason)` sets it (the stores' set_bounds and the receive pool's bound: a shrink
  only lowers it for later arrivals)."""

  def __init__(self, *, budget_bytes: int, device_bound: int,
               apply: Callable[[int, str], None], bound: int = 1) -> None:
    self.budget_bytes = budget_bytes
    self._apply = apply
    self._steps: collections.deque[contract.TrainerStep] = collections.deque(maxlen=WINDOW)
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
    t = contract.TrainerStep.of(figures, run="", max_device_batches=self.device_bound,
                               max_host_batches=self.bound, host_sized=True)
    nbytes = microbatch_bytes([t, *self._steps])
    least = self.device_bound + 1  # the micro-batches a host bound of 1 lets the trainer hold
    if nbytes is not None and least * nbytes > self.budget_bytes:
      alone = nbytes > self.budget_bytes
      self._set(1, over_budget(nbytes, self.budget_bytes, alone and not self._over,
                               "host bound 1", 1 if alone else least), nbytes)
      self._over |= alone
      return
    if t.step_s is None:  # a first step (it compiles; none before it)
      return
    self._steps.append(t)
    self._quiet = 0 if t.pool_waits else self._quiet + 1
    steps = [s for s in self._steps if s.staged] or list(self._steps)
    steps_s = [s.step_s for s in steps]
    pool = Wait.over("receive-pool wait", [s.pool_wait_s for s in steps], steps_s)
    waited = (Wait.over("", [s.mid_step_wait_s for s in steps], steps_s).counts
              or Wait.over("", [s.boundary_wait_s or 0.0 for s in steps], steps_s).counts)
    needs = pool.counts and waited or any(s.pool_over_bound for s in steps)
    nbytes = microbatch_bytes(self._steps)
    fits = nbytes is not None and (self.device_bound + self.bound + 1) * nbytes <= self.budget_bytes
    if needs and fits:
      self._set(self.bound + 1, str(pool), nbytes)
    elif needs:
      self._set(self.bound, f"kept, one more receive buffer would exceed the budget ({pool})",
                nbytes)
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
