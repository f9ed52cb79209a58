"""Sizes of the embedded model and its micro-batches, and the micro-batches themselves.

Both processes import this (numpy only): the orchestrator builds the payloads it sends, and the
trainer rebuilds the very same arrays for the benchmark's `resident` ceiling, so a micro-batch is a
pure function of (seed, step, index, sizes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Sizes:
  """A decoder LM and its micro-batch: tokens [batch, seq] plus ballast [batch, seq, ballast]."""

  vocab: int = 1024
  d_model: int = 256
  layers: int = 4
  heads: int = 4
  seq: int = 128
  batch: int = 16
  # float32 per-token features standing in for an RL payload's log-probs and advantages: they set
  # the payload's bytes (the wire and host-to-device cost) while barely adding compute. The loss
  # reads every value, so a corrupted transfer changes the parameters' digest.
  ballast: int = 2048

  def __post_init__(self) -> None:
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Sizes.{field.name} must be an int >= 1; got {value!r}")
    if self.d_model % self.heads:
      raise ValueError(f"Sizes.d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
    if self.seq < 2:
      raise ValueError(f"Sizes.seq must be >= 2 (next-token targets); got {self.seq}")

  @property
  def payload_bytes(self) -> int:
    return self.batch * self.seq * (4 + 4 * self.ballast)

  def with_payload_mib(self, mib: float) -> "Sizes":
    """The same model with the ballast resized so one micro-batch is about `mib` MiB."""
    if not mib > 0:
      raise ValueError(f"payload size must be > 0 MiB; got {mib!r}")
    per_token = self.batch * self.seq * 4
    ballast = max(1, round((mib * MIB - per_token) / per_token))
    return dataclasses.replace(self, ballast=ballast)

  def as_dict(self) -> dict[str, int]:
    return dataclasses.asdict(self)


DEFAULT_SIZES = Sizes()  # ~0.5 s per fwd_bwd on 2 CPU cores, 16 MiB per micro-batch
TINY_SIZES = Sizes(vocab=64, d_model=32, layers=1, heads=2, seq=16, batch=4, ballast=8)


def mb_id(step: int, index: int) -> str:
  return f"s{step}-m{index}"


@dataclasses.dataclass
class Batch:
  """One micro-batch as it travels: where it belongs (recorded in training order) and its arrays."""

  step: int
  index: int
  arrays: dict[str, np.ndarray]

  @property
  def mb_id(self) -> str:
    return mb_id(self.step, self.index)

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.arrays.values())


def make_batch(sizes: Sizes, seed: int, step: int, index: int) -> Batch:
  rng = np.random.default_rng([seed, step, index])
  tokens = rng.integers(0, sizes.vocab, (sizes.batch, sizes.seq), dtype=np.int32)
  ballast = rng.random((sizes.batch, sizes.seq, sizes.ballast), dtype=np.float32)
  return Batch(step, index, {"tokens": tokens, "ballast": ballast})


def expected_order(steps: int, microbatches: int) -> list[str]:
  return [mb_id(s, i) for s in range(steps) for i in range(microbatches)]


def sizes_from_dict(d: dict[str, Any]) -> Sizes:
  unknown = sorted(set(d) - {f.name for f in dataclasses.fields(Sizes)})
  if unknown:
    raise ValueError(f"unknown size field(s) {unknown}; accepted: {sorted(Sizes().as_dict())}")
  return Sizes(**d)
