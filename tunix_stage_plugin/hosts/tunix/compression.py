"""Compressed stage payloads behind tunix's TrainerWorker (TUNIX_STAGE_CODEC).

The orchestrator packs each large array leaf of a payload's pytree (core.codec, on a worker
thread); the trainer decodes them on its staging lane before placement, so a payload that
compresses below tunix's 128 MiB message cap stages where it could not travel raw. Inline calls
never carry one. docs/codec.md.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.hosts.tunix.packed import CompressedPayload

CodecError = codec_lib.CodecError  # what check and decompress raise


def _is_array(leaf: Any) -> bool:
  return isinstance(leaf, (np.ndarray, jax.Array))


def _map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
  """`fn` over every leaf of `tree`, looking inside dataclass leaves: tunix's TrainerPayload
  types (e.g. RLTrainerPayload, what MaxText's engine trains on) are dataclasses but not
  pytrees, so each is copied with its fields mapped."""

  def leaf(x: Any) -> Any:
    if (dataclasses.is_dataclass(x) and not isinstance(x, (type, codec_lib.PackedArray))):
      out = copy.copy(x)
      for field in dataclasses.fields(x):
        object.__setattr__(out, field.name, _map_leaves(fn, getattr(x, field.name)))
      return out
    return fn(x)

  return jax.tree.map(leaf, tree)


def compress(codec: codec_lib.Codec, payload: Any) -> CompressedPayload:
  """Runs off the event loop: it copies device arrays to host and compresses them."""
  sizes = [0, 0]

  def leaf(x: Any) -> Any:
    if not _is_array(x):
      return x
    sizes[0] += x.nbytes
    if x.nbytes < codec_lib.MIN_PACK_BYTES:
      sizes[1] += x.nbytes
      return x
    packed = codec_lib.pack_array(codec, np.asarray(x))
    sizes[1] += packed.wire_bytes
    return packed

  tree = _map_leaves(leaf, payload)
  return CompressedPayload(codec.name, tree, *sizes)


def check(payload: CompressedPayload) -> Any:
  """Raises codec.CodecError when this process cannot decode it; answers the tree to check."""
  codec_lib.check_decodable(payload.codec)
  return payload.tree


def decompress(payload: CompressedPayload) -> Any:
  """The payload's pytree with numpy arrays again; raises codec.CodecError for damaged bytes."""
  check(payload)
  return _map_leaves(
      lambda x: codec_lib.unpack_array(x) if isinstance(x, codec_lib.PackedArray) else x,
      payload.tree)
