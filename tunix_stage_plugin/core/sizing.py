"""Staging that sizes itself (TUNIX_MAX_STAGED_BATCHES=auto): each step's stage-ahead depth chosen
by the one rule of what to change (core.telemetry.advice.choose_depth) from the figures the last
steps measured, within a memory budget in bytes that the staged micro-batches never exceed. It
answers the pipeline's `depth_for(step, depth)` seam. docs/simulate.md "auto".
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from tunix_stage_plugin.core.telemetry import advice

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Choice:
  step: int
  depth: int
  reason: str  # "depth 2: <the figure that decided>; budget 6.0 GiB, 4.2 used"


class Sizer:
  """Feed it each step's figures (`observe`: the trainer's and the orchestrator's, as the records
  hold them); the pipeline asks it each step's depth (`depth_for`). It starts at depth 1 (the
  least memory), goes deeper when the rule asks and the budget holds it (depth x micro-batch
  bytes <= budget), and never shallower than a depth the trainer was seen to need (waits with
  the depth used up) unless the wire becomes the bound."""

  def __init__(self, *, budget_bytes: int, microbatch_bytes: int, window: int = 3) -> None:
    if budget_bytes < microbatch_bytes or microbatch_bytes < 1:
      raise ValueError(f"a budget of {budget_bytes} bytes holds no micro-batch of "
                       f"{microbatch_bytes} bytes")
    self.budget_bytes, self.microbatch_bytes = budget_bytes, microbatch_bytes
    self.most = budget_bytes // microbatch_bytes
    self._trainer: collections.deque[dict[str, Any]] = collections.deque(maxlen=window)
    self._orchestrator: collections.deque[dict[str, Any]] = collections.deque(maxlen=window)
    self._floor = 1  # the deepest depth the trainer was seen to need
    self._floor_why = ""
    # The last few steps' choices: a step's depth is chosen before the step before it ends.
    self.choices: collections.deque[Choice] = collections.deque(maxlen=4)

  def observe(self, trainer: dict[str, Any] | None, orchestrator: dict[str, Any] | None) -> None:
    """One step's figures (either side may be missing in a step)."""
    if trainer is not None:
      self._trainer.append(trainer)
    if orchestrator is not None:
      self._orchestrator.append(orchestrator)

  def depth_for(self, step: int, depth: int) -> int:  # pylint: disable=unused-argument
    """The pipeline's seam: `step`'s depth (`depth`, the configured one, is not used)."""
    window = advice.Window.of_records(list(self._trainer), list(self._orchestrator))
    chosen, why, needed = advice.choose_depth(window, self.most)
    if needed and chosen > self._floor:
      self._floor, self._floor_why = chosen, why
    if chosen < self._floor and (window is None or not window.wire_is_the_bound):
      chosen, why = self._floor, f"kept: the trainer waited with a depth less ({self._floor_why})"
    used = chosen * self.microbatch_bytes
    self.choices.append(Choice(step, chosen, f"depth {chosen}: {why}; budget "
                               f"{self._size(self.budget_bytes)}, {self._size(used)} used"))
    return chosen

  def chosen(self, step: int) -> Choice:
    """The choice made for `step`, one of the last few asked."""
    return next(c for c in reversed(self.choices) if c.step == step)

  def _size(self, nbytes: int) -> str:
    if self.microbatch_bytes == 1:  # a budget counted in micro-batches (the simulator's)
      return f"{nbytes} micro-batch{'' if nbytes == 1 else 'es'}"
    return f"{nbytes / GIB:.1f} GiB"
