"""Compressed stage payloads (TUNIX_STAGE_CODEC): lossless packing, and the embedded host end to
end (a real JAX trainer process, real gRPC on 127.0.0.1) with the rl payload.

The tests that compress need a codec library (the `codec` extra) and are skipped, with that
reason, without it; the rl payload's staged-vs-inline check runs everywhere.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.embedded.support import TINY, call, inline_digest_of, run_plan
from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import job as job_lib
from tunix_stage_plugin.lab.embedded import worker as worker_lib

INSTALLED = [name for name in codec_lib.CODECS if codec_lib.installed(name)]
needs_codec = pytest.mark.skipif(
    not INSTALLED, reason=f"no codec library installed ({codec_lib.EXTRA})")
DEFAULT = INSTALLED[0] if INSTALLED else None  # blosc2-zstd where the extra is installed
# Large enough that routed_experts and the log-probs are packed (>= MIN_PACK_BYTES each).
RL = TINY.with_payload(data_lib.PAYLOAD_RL).with_payload_mib(1)
STEPS, MB = 2, 4
EXPECTED = data_lib.expected_order(STEPS, MB)
STAGED = job_lib.JobPlan(STEPS, MB, kind="staged", depth=2, prestage=True)


def codecs(*names: str) -> list:
  return [pytest.param(n, marks=pytest.mark.skipif(
      not codec_lib.installed(n), reason=f"{codec_lib.MODULES[n]} not installed")) for n in names]


@pytest.mark.parametrize("name", codecs(*codec_lib.CODECS))
def test_every_codec_round_trips_an_rl_batch_byte_for_byte(name):
  batch = data_lib.make_batch(RL, 3, 1, 2)
  codec = codec_lib.parse(f"{name}:{codec_lib.DEFAULT_LEVELS[name]}")
  packed = data_lib.pack_batch(codec, batch)
  arrays = packed.packed.arrays
  assert isinstance(arrays["routed_experts"], codec_lib.PackedArray)
  assert isinstance(arrays["advantages"], np.ndarray)  # small: travels as it is
  assert packed.wire_bytes < batch.nbytes / 2  # padding and repeated expert ids compress
  out = data_lib.unpack_batch(packed)
  assert list(out.arrays) == list(batch.arrays)
  for key, array in batch.arrays.items():
    assert out.arrays[key].dtype == array.dtype and out.arrays[key].shape == array.shape
    assert out.arrays[key].tobytes() == array.tobytes(), key
    assert out.arrays[key].ctypes.data % 64 == 0 or out.arrays[key] is arrays[key]


def _corrupt(packed: data_lib.PackedBatch) -> data_lib.PackedBatch:
  """Flips one byte in the middle of every compressed chunk (a bit error on the wire)."""
  for p in packed.packed.arrays.values():
    if not isinstance(p, codec_lib.PackedArray):
      continue
    p.chunks = [c.copy() for c in p.chunks]
    for c in p.chunks:
      c[c.size // 2] ^= 0x5A
  return packed


@pytest.mark.parametrize("name", codecs(*codec_lib.CODECS))
def test_a_corrupted_or_truncated_chunk_raises_codec_error(name):
  batch = data_lib.make_batch(RL, 0, 0, 0)
  codec = codec_lib.parse(name)
  with pytest.raises(codec_lib.CodecError):
    data_lib.unpack_batch(_corrupt(data_lib.pack_batch(codec, batch)))
  truncated = data_lib.pack_batch(codec, batch)
  first = truncated.packed.arrays["routed_experts"]
  first.chunks = [c[:c.size // 2] for c in first.chunks]
  with pytest.raises(codec_lib.CodecError):
    data_lib.unpack_batch(truncated)


class CorruptingEngine(client_lib.EmbeddedEngine):
  """The real engine; the packed bytes of the micro-batches in `corrupt` are damaged after packing,
  as a bad link would (there is no real way to make gRPC over loopback flip a bit)."""

  def __init__(self, client, *, corrupt: frozenset[str], **kwargs) -> None:
    super().__init__(client, **kwargs)
    self.corrupt = corrupt

  def _pack(self, payload):
    packed = super()._pack(payload)
    return _corrupt(packed) if payload.mb_id in self.corrupt else packed


@pytest.fixture(scope="module")
def inline_digest(trainer):
  return inline_digest_of(trainer.address, STEPS, MB, sizes=RL)


def test_uncompressed_staging_of_the_rl_payload_matches_inline(trainer, inline_digest):
  result = run_plan(trainer.address, STAGED, sizes=RL)
  assert result.finish["param_digest"] == inline_digest
  assert result.wire.stage_sent_bytes == result.wire.stage_raw_bytes > 0


@pytest.mark.parametrize("name", codecs(*codec_lib.CODECS))
def test_compressed_staging_trains_to_the_same_parameters_as_inline(trainer, inline_digest, name):
  engine = functools.partial(client_lib.EmbeddedEngine, codec=codec_lib.parse(name))
  result = run_plan(trainer.address, STAGED, sizes=RL, engine=engine)
  assert result.finish["trained_order"] == EXPECTED
  assert result.finish["param_digest"] == inline_digest
  assert result.fallbacks == [0] * STEPS
  assert result.finish["store"]["consumed"] == result.wire.stages > 0
  assert result.wire.stages + result.wire.inline == STEPS * MB  # the pipeline's own inline ones
  assert result.wire.stage_sent_bytes < result.wire.stage_raw_bytes / 2
  assert result.wire.stage_raw_bytes == result.wire.stages * RL.payload_bytes
  # Each compressed stage was decoded once, on the staging lane, right before its placement.
  spans = call(trainer.address, "timeline")
  decoded = {s.name: s for s in spans if s.track == tracks.TRAINER_DECODE}
  placed = {s.name: s for s in spans
            if s.track == tracks.TRAINER_H2D and dict(s.args)["lane"] == "staging"}
  assert len(decoded) == result.wire.stages and decoded.keys() == placed.keys()
  for name, span in decoded.items():
    assert span.end <= placed[name].start
    assert dict(span.args)["wire_bytes"] < dict(span.args)["bytes"] == RL.payload_bytes


@needs_codec
def test_a_corrupted_compressed_payload_falls_back_inline_and_is_counted(trainer, inline_digest):
  engine = functools.partial(CorruptingEngine, codec=codec_lib.parse(DEFAULT),
                             corrupt=frozenset({"s0-m1", "s1-m3"}))
  result = run_plan(trainer.address, STAGED, sizes=RL, engine=engine)
  assert result.fallbacks == [1, 1]
  reasons = [r for o in result.outcomes for r in o.report.fallback_reasons]
  assert len(reasons) == 2 and all("did not decode" in r for r in reasons), reasons
  assert result.finish["store"]["failed"] == 2
  clean = run_plan(trainer.address, STAGED, sizes=RL,
                   engine=functools.partial(client_lib.EmbeddedEngine,
                                            codec=codec_lib.parse(DEFAULT)))
  # each corrupted one is sent again, uncompressed, with its train call
  assert result.wire.inline == clean.wire.inline + 2
  assert result.finish["trained_order"] == EXPECTED
  assert result.finish["param_digest"] == inline_digest


def test_a_trainer_without_the_codec_refuses_a_compressed_stage_at_once(monkeypatch):
  """In-process worker (no gRPC needed for the refusal); runs without any codec library."""
  worker = worker_lib.TrainerWorker(config_lib.resolve({"mode": "stage"}, env={}))
  worker.setup(sizes=TINY.as_dict())
  monkeypatch.setattr(codec_lib, "installed", lambda name: False)
  batch = data_lib.make_batch(TINY, 0, 0, 1)
  packed = data_lib.PackedBatch(0, 1, data_lib.PackedArrays("blosc2-lz4", dict(batch.arrays)))
  outcome = worker.stage_batch(packed, key="z-1")
  assert outcome["status"] == "refused"
  assert "codec blosc2-lz4 is not installed on the trainer" in outcome["reason"]
  assert codec_lib.EXTRA in outcome["reason"] and worker.store.keys() == []
