"""Typed results from the trainer to the orchestrator's pipeline: one per stage attempt
(StageOutcome, with the trainer's newest closed step in numbers on it: TrainerStep) and one per
train call (Trained). The pipeline acts on the status alone
(docs/design.md, "Core semantics"): it never reads a reason's text.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class StageStatus(enum.Enum):
  STAGED = "staged"  # placed under its key; train it by key
  REFUSED = "refused"  # nothing is held on the trainer (bound, reset, not stageable): train inline
  FAILED = "failed"  # the trainer may hold something (an error mid-stage, a lost reply): reset, inline
  UNSUPPORTED = "unsupported"  # this trainer can never stage: train inline and stop offering
  # A train call's, never a stage's: staged, but the trainer could not place it and trained it
  # inline from its payload (Trained.fallback).
  UNPLACED = "unplaced"


@dataclasses.dataclass(frozen=True)
class StageOutcome:
  key: str
  status: StageStatus
  reason: str | None = None  # why not staged, for logs and reports
  # The trainer's newest closed step, where the trainer sends it (auto sizes from it).
  trainer: "TrainerStep | None" = dataclasses.field(default=None, compare=False)

  @property
  def staged(self) -> bool:
    return self.status is StageStatus.STAGED

  def carrying(self, trainer: "TrainerStep | None") -> "StageOutcome":
    """This outcome with the trainer's newest closed step on it (a stage answer's)."""
    return dataclasses.replace(self, trainer=trainer)

  def as_dict(self) -> dict[str, Any]:
    """The form that travels in a reply (plain types only)."""
    return {"key": self.key, "status": self.status.value, "reason": self.reason,
            "trainer": None if self.trainer is None else self.trainer.as_dict()}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "StageOutcome":
    trainer = d.get("trainer")  # absent from a trainer that sends none
    return cls(d["key"], StageStatus(d["status"]), d["reason"],
               None if trainer is None else TrainerStep.from_dict(trainer))


def staged(key: str) -> StageOutcome:
  return StageOutcome(key, StageStatus.STAGED)


def refused(key: str, reason: str) -> StageOutcome:
  return StageOutcome(key, StageStatus.REFUSED, reason)


def failed(key: str, reason: str) -> StageOutcome:
  return StageOutcome(key, StageStatus.FAILED, reason)


def unsupported(key: str, reason: str) -> StageOutcome:
  return StageOutcome(key, StageStatus.UNSUPPORTED, reason)


@dataclasses.dataclass(frozen=True)
class Trained:
  """What an engine's train call returns: the host's result and, for a micro-batch sent by key
  whose placement failed on the trainer, why it was trained inline from the held payload."""

  result: Any
  fallback: str | None = None


class StagedPayloadUnreadable(RuntimeError):
  """Raised by an engine's train(stage_key=...) when the trainer could not decode the staged
  payload (compressed bytes damaged, or no codec there) and trained nothing: the pipeline trains
  that micro-batch inline instead and counts a fallback. Trainers raise it by this name."""


@dataclasses.dataclass(frozen=True)
class TrainerStep:
  """A trainer's newest closed step in numbers, riding on each stage_batch answer: what a depth
  sized each step (auto, core/sizing.py) reads of the trainer, and a host bound sized each step
  reads of its own steps. Seconds are the step's sums over its micro-batches, but `fwd_bwd_s`
  (a micro-batch's compute, the step's median). `of` makes it from the figures a trainer's step
  aggregator made (core/telemetry/trainer.py; their shape: core/telemetry/figures.py)."""

  run: str  # the trainer's run: a step is read once
  step: int
  step_s: float | None  # None: the trainer's first step (it compiles, no step before it)
  compute_s: float
  mid_step_wait_s: float  # the device idle mid-step, waiting for its input
  boundary_wait_s: float | None  # ... at the step boundary (None: a first step)
  other_s: float  # the compute lane's own calls
  microbatches: int  # fwd_bwd computations
  fwd_bwd_s: float | None
  received: int  # micro-batches received by side channel or stream (0: by tunix's own call)
  received_s: float
  received_bytes: int
  placed: int
  placed_s: float
  placed_bytes: int
  staged: int  # placements on the staging lane
  pool_waits: int  # transfers that waited for a receive buffer
  pool_wait_s: float
  pool_over_bound: int  # waits that ran out
  max_device_batches: int  # the bounds in force on the trainer
  max_host_batches: int
  host_sized: bool  # it sizes its host bound itself (it may then hold one more)

  @classmethod
  def of(cls, figures: dict[str, Any], *, run: str, max_device_batches: int,
         max_host_batches: int, host_sized: bool) -> "TrainerStep":
    """From a step's figures as the trainer's step aggregator made them, and the bounds in
    force; KeyError where the figures lack one (a broken contract)."""
    wait, receive, place, pool = (figures["input_wait_s"], figures["receive"], figures["place"],
                                  figures["pool"])
    return cls(run=run, step=figures["step"], step_s=figures["step_s"],
               compute_s=figures["compute_s"], mid_step_wait_s=wait["mid_step"],
               boundary_wait_s=wait["boundary"], other_s=figures["other_s"],
               microbatches=figures["microbatches"], fwd_bwd_s=figures["compute"]["fwd_bwd_median_s"], received=receive["calls"],
               received_s=receive["seconds"], received_bytes=receive["bytes"],
               placed=place["count"], placed_s=place["seconds"], placed_bytes=place["bytes"],
               staged=place["staged"], pool_waits=pool["waits"], pool_wait_s=pool["wait_s"],
               pool_over_bound=pool["over_bound"], max_device_batches=max_device_batches,
               max_host_batches=max_host_batches, host_sized=host_sized)

  @property
  def holds(self) -> int:
    """The most micro-batches the trainer can hold staged: its device and host bounds, one more
    where it sizes its host bound itself."""
    return self.max_device_batches + self.max_host_batches + (1 if self.host_sized else 0)

  def as_dict(self) -> dict[str, Any]:
    """The form that travels in a reply (plain types only)."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "TrainerStep":
    return cls(**d)
