"""The report's advice checked against the simulator: the job's own record replayed in virtual time
with the settings it ran with, then with each advised change, so that `tunix-stage report`
recommends a change only where the simulator predicts it shortens the step, and says by how much;
a record of a run that did not stage, inline and then staged at the default.
The report imports this module by name only where the lab is installed (the production path
imports nothing from the lab). docs/observability.md "Reading the figures".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tunix_stage_plugin.core import inputs
from tunix_stage_plugin.core import advice as advice_lib
from tunix_stage_plugin.lab.sim import run as run_lib
from tunix_stage_plugin.lab.sim import trace as trace_lib

# A change is recommended when the simulator predicts it shortens the mean step by this share.
MIN_GAIN = 0.01
# The check replays a record's last this many trainer steps (a simulation's time grows with its
# micro-batches: a long record is judged on its recent steps, in about a second a change).
CHECK_STEPS = 100
# Staging at the default, as the simulator runs it: the depth sized each step (auto, its default
# budget), prestaging; and a run that did not stage, as it ran.
DEFAULT_MODE, INLINE = "auto", "inline"
# What the advice names that the simulator does not model: it cannot judge those changes.
UNMODELLED = {advice_lib.HOST_BOUND: "the trainer's receive pool",
              advice_lib.CORES: "the cores a receive shares with the compute"}


@dataclasses.dataclass(frozen=True)
class Prediction:
  """The mean step (over the steps after the first, which fills the pipeline) the simulator
  predicts with the settings the job ran with, and with the change."""

  before_s: float
  after_s: float
  wire: float = 1.0  # the factor the change put on the wire's time
  modes: str = ""  # the modes replayed, where the change is one of mode ("inline -> auto")

  @property
  def helps(self) -> bool:
    return self.after_s <= self.before_s * (1.0 - MIN_GAIN)

  def __str__(self) -> str:
    how = f" (the wire x{self.wire:g})" if self.wire != 1.0 else (
        f" ({self.modes})" if self.modes else "")
    return f"simulate predicts {self.before_s:.2f} s -> {self.after_s:.2f} s a step{how}"


def _mean(trace: trace_lib.Trace, mode: str, settings: advice_lib.Settings) -> float:
  result = run_lib.simulate(trace, mode, max_device_batches=settings.max_device_batches,
                            max_host_batches=settings.max_host_batches)
  return math.fsum(result.step_s) / len(result.step_s)


def mean_step(trace: trace_lib.Trace, settings: advice_lib.Settings) -> float:
  return _mean(trace, settings.mode, settings)


def staging_on(trainer: Any, settings: advice_lib.Settings) -> Prediction | str:
  """A run that did not stage: its last CHECK_STEPS trainer steps replayed inline, as it ran,
  then staged at the default (DEFAULT_MODE), both with the trainer's bounds (`settings`'); or why
  there is no prediction (one line)."""
  try:
    trace = trace_lib.of_steps(trainer.iloc[-CHECK_STEPS:], "the record")
    before, after = (_mean(trace, mode, settings) for mode in (INLINE, DEFAULT_MODE))
  except (trace_lib.TraceError, inputs.Refused) as e:
    return f"not checked ({e})"
  return Prediction(before, after, modes=f"{INLINE} -> {DEFAULT_MODE}")


def predict(trainer: Any, settings: advice_lib.Settings,
            advice: list[advice_lib.Advice]) -> list[Prediction | str]:
  """Per advice, the simulator's prediction on one run's last CHECK_STEPS trainer steps (its
  table in step order: reading.runs), or why there is none (one line: a change the simulator
  cannot try, a record past its bounds)."""
  try:
    trace = trace_lib.of_steps(trainer.iloc[-CHECK_STEPS:], "the record")
    before = mean_step(trace, settings)
  except (trace_lib.TraceError, inputs.Refused) as e:
    return [f"not checked ({e})"] * len(advice)
  out: list[Prediction | str] = []
  for a in advice:
    if a.change is None or a.kind in UNMODELLED:
      out.append(f"not checked (simulate does not model {UNMODELLED[a.kind]})")
      continue
    try:
      after = mean_step(trace.scaled({"wire": a.change.wire}), a.change.applied(settings))
    except (trace_lib.TraceError, inputs.Refused) as e:
      out.append(f"not checked ({e})")
      continue
    out.append(Prediction(before, after, a.change.wire))
  return out
