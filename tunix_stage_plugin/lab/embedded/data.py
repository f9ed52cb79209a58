"""Sizes of the embedded model and its micro-batches, and the micro-batches themselves.

Both processes import this (numpy only): the orchestrator builds the payloads it sends, and the
trainer rebuilds the very same arrays for the benchmark's `resident` ceiling, so a micro-batch is a
pure function of (seed, step, index, sizes).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from tunix_stage_plugin.transport import wire

if TYPE_CHECKING:  # the codec loads where a codec is set
  from tunix_stage_plugin.core import codec as codec_lib
  from tunix_stage_plugin.transport import listener as listener_lib

MIB = 1 << 20

PAYLOAD_DENSE = "dense"
PAYLOAD_RL = "rl"
PAYLOADS = (PAYLOAD_DENSE, PAYLOAD_RL)
# Per token of an rl micro-batch, before routed_experts: tokens, positions, segment ids (int32),
# old and ref log-probs (f32), loss mask (int8).
RL_TOKEN_BYTES = 4 + 4 + 4 + 4 + 4 + 1
# Long-tailed response lengths: lognormal(mean log, sigma) in units of seq, clipped to [2, seq].
RL_LENGTH_MU, RL_LENGTH_SIGMA = -1.2, 0.8
RL_EXPERTS = 64


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
  # "dense": tokens + float32 ballast (the default). "rl": a realistic RL micro-batch (make_batch):
  # ids, masks, advantages, log-probs and routed_experts [batch, seq, routed_layers, top_k] int16.
  payload: str = PAYLOAD_DENSE
  routed_layers: int = 4  # rl only: MoE layers whose routing travels (sized by with_payload_mib)
  top_k: int = 8  # rl only

  def __post_init__(self) -> None:
    if self.payload not in PAYLOADS:
      raise ValueError(f"Sizes.payload must be one of {', '.join(PAYLOADS)}; got {self.payload!r}")
    for field in dataclasses.fields(self):
      if field.name == "payload":
        continue
      value = getattr(self, field.name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Sizes.{field.name} must be an int >= 1; got {value!r}")
    if self.d_model % self.heads:
      raise ValueError(f"Sizes.d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
    if self.seq < 2:
      raise ValueError(f"Sizes.seq must be >= 2 (next-token targets); got {self.seq}")

  @property
  def payload_bytes(self) -> int:
    if self.payload == PAYLOAD_RL:
      return (self.batch * self.seq * (RL_TOKEN_BYTES + 2 * self.routed_layers * self.top_k)
              + 4 * self.batch)
    return self.batch * self.seq * (4 + 4 * self.ballast)

  def with_payload(self, payload: str) -> "Sizes":
    return dataclasses.replace(self, payload=payload)

  def with_payload_mib(self, mib: float) -> "Sizes":
    """The same model with the ballast (dense) or the routed layers (rl) resized so one
    micro-batch is about `mib` MiB."""
    if not mib > 0:
      raise ValueError(f"payload size must be > 0 MiB; got {mib!r}")
    if self.payload == PAYLOAD_RL:
      tokens = self.batch * self.seq
      per_layer = tokens * 2 * self.top_k
      layers = max(1, round((mib * MIB - tokens * RL_TOKEN_BYTES - 4 * self.batch) / per_layer))
      return dataclasses.replace(self, routed_layers=layers)
    per_token = self.batch * self.seq * 4
    ballast = max(1, round((mib * MIB - per_token) / per_token))
    return dataclasses.replace(self, ballast=ballast)

  def array_shapes(self) -> dict[str, tuple[int, ...]]:
    """Each array of a micro-batch: its shape (what the trainer checks before placing)."""
    b, t = self.batch, self.seq
    if self.payload == PAYLOAD_RL:
      return {"tokens": (b, t), "positions": (b, t), "segment_ids": (b, t), "loss_mask": (b, t),
              "advantages": (b,), "old_logprobs": (b, t), "ref_logprobs": (b, t),
              "routed_experts": (b, t, self.routed_layers, self.top_k)}
    return {"tokens": (b, t), "ballast": (b, t, self.ballast)}

  def array_layout(self) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each array of a micro-batch: its shape and dtype."""
    if self.payload == PAYLOAD_RL:
      dtypes = {"tokens": "int32", "positions": "int32", "segment_ids": "int32",
                "loss_mask": "int8", "advantages": "float32", "old_logprobs": "float32",
                "ref_logprobs": "float32", "routed_experts": "int16"}
    else:
      dtypes = {"tokens": "int32", "ballast": "float32"}
    return {name: (shape, dtypes[name]) for name, shape in self.array_shapes().items()}

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


def rl_lengths(sizes: Sizes, rng: np.random.Generator) -> np.ndarray:
  """Each sequence's real length: long-tailed (lognormal), clipped to [2, seq]."""
  frac = rng.lognormal(RL_LENGTH_MU, RL_LENGTH_SIGMA, sizes.batch)
  return np.clip(np.round(frac * sizes.seq), 2, sizes.seq).astype(np.int32)


def _aligned_copy(array: np.ndarray) -> np.ndarray:
  out = wire.aligned_empty(array.nbytes).view(array.dtype).reshape(array.shape)
  np.copyto(out, array)
  return out


def _bulk(sizes: Sizes, seed: int, index: int) -> dict[str, np.ndarray]:
  """A position's bulk array (and, for rl, the lengths that pad it), 64-byte aligned."""
  rng = np.random.default_rng([seed, index])
  b, t = sizes.batch, sizes.seq
  if sizes.payload == PAYLOAD_RL:
    lengths = rl_lengths(sizes, rng)
    live = np.arange(t)[None, :] < lengths[:, None]  # [b, t]
    # Top-k routing per token and layer: expert ids of RL_EXPERTS with a skewed popularity (low
    # ids more often: u**3), so ids repeat as real routers' do; -1 past each sequence's length.
    draws = rng.random((b, t, sizes.routed_layers, sizes.top_k), dtype=np.float32)
    routed = (draws * draws * draws * RL_EXPERTS).astype(np.int16)
    del draws
    routed[~live] = -1
    return {"live": live, "routed_experts": _aligned_copy(routed)}
  ballast = wire.aligned_empty(b * t * sizes.ballast * 4).view(np.float32)
  rng.random(dtype=np.float32, out=ballast)
  return {"ballast": ballast.reshape(b, t, sizes.ballast)}


def _per_step(sizes: Sizes, bulk: dict[str, np.ndarray], rng: np.random.Generator
              ) -> dict[str, np.ndarray]:
  b, t = sizes.batch, sizes.seq
  if sizes.payload != PAYLOAD_RL:
    return {"tokens": rng.integers(0, sizes.vocab, (b, t), dtype=np.int32),
            "ballast": bulk["ballast"]}
  live = bulk["live"]
  tokens = np.where(live, rng.integers(1, sizes.vocab, (b, t), dtype=np.int32), 0).astype(np.int32)
  positions = np.where(live, np.arange(t, dtype=np.int32)[None, :], 0).astype(np.int32)
  old = np.where(live, -rng.exponential(2.0, (b, t)), 0.0).astype(np.float32)
  ref = np.where(live, old + rng.normal(0.0, 0.05, (b, t)), 0.0).astype(np.float32)
  return {"tokens": tokens, "positions": positions, "segment_ids": live.astype(np.int32),
          "loss_mask": live.astype(np.int8),
          "advantages": rng.normal(0.0, 1.0, b).astype(np.float32),
          "old_logprobs": old, "ref_logprobs": ref, "routed_experts": bulk["routed_experts"]}


class BatchMaker:
  """Micro-batch (step, index) of `sizes` from `seed`: a pure function of the four.

  A micro-batch's bulk array (the dense ballast; the rl routed_experts, with the lengths that pad
  every per-token field) depends on (seed, index) only: it is made once per position of a step,
  64-byte aligned, and shared by every step; its tokens and per-token values are new each step
  (from (seed, step, index)), so every step trains different data. A job therefore holds one bulk
  array per position, whatever its steps, and builds it once (a 1 GiB one takes over a second of
  a core, longer than a micro-batch computes). Callers must not write into the arrays.
  """

  def __init__(self, sizes: Sizes, seed: int) -> None:
    self.sizes = sizes
    self.seed = seed
    self._bulk: dict[int, dict[str, np.ndarray]] = {}

  def __call__(self, step: int, index: int) -> Batch:
    bulk = self._bulk.get(index)
    if bulk is None:
      bulk = self._bulk[index] = _bulk(self.sizes, self.seed, index)
    rng = np.random.default_rng([self.seed, step, index])
    return Batch(step, index, _per_step(self.sizes, bulk, rng))


def make_batch(sizes: Sizes, seed: int, step: int, index: int) -> Batch:
  """One micro-batch, built from scratch (BatchMaker shares the bulk arrays across steps)."""
  return BatchMaker(sizes, seed)(step, index)


@dataclasses.dataclass
class PackedArrays:
  """A dict of arrays as it travels: the large ones codec.PackedArray, the others as they are."""

  codec: str  # codec.Codec.name
  arrays: dict[str, np.ndarray | codec_lib.PackedArray]  # in the original key order

  @property
  def nbytes(self) -> int:
    """The arrays' bytes once decoded."""
    return sum(a.nbytes for a in self.arrays.values())

  @property
  def wire_bytes(self) -> int:
    """The arrays' bytes as they travel."""
    return sum(getattr(a, "wire_bytes", a.nbytes) for a in self.arrays.values())


def _codec() -> Any:
  """core/codec.py, loaded where a codec is set or a packed batch arrives."""
  from tunix_stage_plugin.core import codec  # pylint: disable=import-outside-toplevel
  return codec


def pack_arrays(codec: codec_lib.Codec, arrays: dict[str, np.ndarray]) -> PackedArrays:
  """Each array of at least codec.MIN_PACK_BYTES compressed (codec.pack_array)."""
  codec_lib = _codec()
  return PackedArrays(codec.name, {
      name: codec_lib.pack_array(codec, a)
      if isinstance(a, np.ndarray) and a.nbytes >= codec_lib.MIN_PACK_BYTES else a
      for name, a in arrays.items()})


def unpack_arrays(packed: PackedArrays, *, threads: int = 0,
                  pool: listener_lib.HostBufferPool | None = None) -> dict[str, np.ndarray]:
  """The arrays, decoded and checked; raises codec.CodecError otherwise."""
  codec_lib = _codec()
  codec_lib.check_decodable(packed.codec)
  return {name: codec_lib.unpack_array(a, threads=threads, name=name, pool=pool)
          if isinstance(a, codec_lib.PackedArray) else a for name, a in packed.arrays.items()}


@dataclasses.dataclass
class PackedBatch:
  """A micro-batch whose large arrays travel compressed (TUNIX_STAGE_CODEC; core.codec): only a
  stage sends one, and the trainer unpacks it on its staging lane before placing it."""

  step: int
  index: int
  packed: PackedArrays

  @property
  def mb_id(self) -> str:
    return mb_id(self.step, self.index)

  @property
  def nbytes(self) -> int:
    return self.packed.nbytes

  @property
  def wire_bytes(self) -> int:
    return self.packed.wire_bytes


def pack_batch(codec: codec_lib.Codec, batch: Batch) -> PackedBatch:
  return PackedBatch(batch.step, batch.index, pack_arrays(codec, batch.arrays))


def unpack_batch(packed: PackedBatch, pool: Any = None) -> Batch:
  """Decoded into buffers from `pool` (a transport.listener.HostBufferPool) when given; raises
  core.codec.CodecError for a payload that does not decode to what it announced."""
  return Batch(packed.step, packed.index, unpack_arrays(packed.packed, pool=pool))


def expected_order(steps: int, microbatches: int) -> list[str]:
  return [mb_id(s, i) for s in range(steps) for i in range(microbatches)]


def sizes_from_dict(d: dict[str, Any]) -> Sizes:
  """Sizes from its as_dict (older dicts without payload fields mean the dense payload)."""
  unknown = sorted(set(d) - {f.name for f in dataclasses.fields(Sizes)})
  if unknown:
    raise ValueError(f"unknown size field(s) {unknown}; accepted: {sorted(Sizes().as_dict())}")
  return Sizes(**d)
