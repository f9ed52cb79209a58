"""Typed results from the trainer to the orchestrator's pipeline: one per stage attempt
(StageOutcome) and one per train call (Trained). The pipeline acts on the status alone
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

  @property
  def staged(self) -> bool:
    return self.status is StageStatus.STAGED

  def as_dict(self) -> dict[str, str | None]:
    """The form that travels in a reply (plain types only)."""
    return {"key": self.key, "status": self.status.value, "reason": self.reason}

  @classmethod
  def from_dict(cls, d: dict[str, str | None]) -> "StageOutcome":
    return cls(d["key"], StageStatus(d["status"]), d["reason"])


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
  """A trainer's newest closed step, as its stage_figures call answers it: what a depth sized
  each step (auto) reads of the trainer. `figures`: the step's figures as its aggregator made
  them (core/telemetry/trainer.py); the bounds in force on the trainer, and whether it sizes its
  host bound itself (it may then hold one more)."""

  run: str  # the trainer's run, so that a step is read once
  figures: dict[str, Any]
  max_device_batches: int
  max_host_batches: int
  host_sized: bool

  @property
  def step(self) -> int:
    return self.figures["step"]

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
