"""Lossless compression of a staged micro-batch's large arrays (TUNIX_STAGE_CODEC; docs/codec.md).

`pack_array` turns one array of at least MIN_PACK_BYTES into a PackedArray (compressed chunks, the
dtype, shape and crc32 of its raw bytes); `unpack_array` decompresses into a fresh 64-byte-aligned
buffer and checks size and crc32, so a corrupted payload raises CodecError and never yields a wrong
array. A spec naming a library that is not installed is refused with the pip command that fits
(core.install_hint). `compress_payload` maps `pack_array` over a payload's pytree (tunix's
host, on a worker thread of the orchestrator), `decompress_payload` back (on the trainer's placer
thread); the embedded host packs its own batches (lab/embedded/data.py). The chunks are numpy
uint8 arrays, so they travel out of band in the plugin's encoding (transport/wire.py) and in band
in tunix's own cloudpickle.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import zlib
from typing import Any, Callable

import numpy as np

from tunix_stage_plugin.transport import wire

# The spec's grammar (names, levels, defaults, what is accepted) lives in codec_spec, without
# numpy, so core.config can say what it accepts; re-exported here (codec.LEVELS is that table).
# pylint: disable-next=unused-import
from tunix_stage_plugin.core import install_hint
from tunix_stage_plugin.core.codec_spec import ACCEPTED, CODECS, DEFAULT_CODEC, DEFAULT_LEVELS
from tunix_stage_plugin.core.codec_spec import CodecUnavailable, CompressedPayload
from tunix_stage_plugin.core.codec_spec import EXTRA, EXTRA_NAME, LEVELS, MODULES, OFF, ON

MIN_PACK_BYTES = 64 << 10  # smaller arrays travel raw: their bytes are not worth a codec call
CHUNK_BYTES = 64 << 20  # under every codec's 2 GiB per-call limit; one decode call per chunk


class CodecError(RuntimeError):
  """A packed payload does not decode to what it announced (corrupt or truncated)."""


@dataclasses.dataclass(frozen=True)
class Codec:
  name: str
  level: int
  threads: int = 0  # compression threads (blosc2, zstd); 0: every core this process may use

  def __str__(self) -> str:
    return f"{self.name}:{self.level}"

  @property
  def nthreads(self) -> int:
    return self.threads or len(os.sched_getaffinity(0))


def extra_hint() -> str:
  """The extra, and the pip command that adds it to this installation."""
  return f"{EXTRA}: {install_hint.install_command(EXTRA_NAME)}"


def installed(name: str) -> bool:
  return importlib.util.find_spec(MODULES[name]) is not None


def parse(text: str, *, require_installed: bool = True) -> Codec | None:
  """`off` -> None, `on` / `NAME[:LEVEL]` -> Codec; ValueError (CodecUnavailable: not installed)."""
  value = text.strip()
  if value == OFF:
    return None
  if value == ON:
    value = DEFAULT_CODEC
  name, sep, level_text = value.partition(":")
  if name not in CODECS or (sep and not level_text):
    raise ValueError(value)
  if level_text:
    if not (level_text.isascii() and level_text.isdigit() and len(level_text) <= 3):
      raise ValueError(value)  # plain decimal digits, as every number of the settings
    level = int(level_text)
    low, high = LEVELS[name]
    if not low <= level <= high:
      raise ValueError(value)
  else:
    level = DEFAULT_LEVELS[name]
  if require_installed and not installed(name):
    raise CodecUnavailable(f"codec {name} needs the Python package {MODULES[name]}, which is not "
                           f"installed ({extra_hint()})")
  return Codec(name, level)


def compress(codec: Codec, data: memoryview, itemsize: int) -> bytes:
  """One chunk (at most CHUNK_BYTES)."""
  import blosc2  # pylint: disable=import-outside-toplevel
  which = blosc2.Codec.ZSTD if codec.name == "blosc2-zstd" else blosc2.Codec.LZ4
  return blosc2.compress2(data, typesize=itemsize, clevel=codec.level, codec=which,
                          filters=[blosc2.Filter.SHUFFLE], nthreads=codec.nthreads)


def decompress_into(codec_name: str, data: Any, out: np.ndarray, threads: int = 0) -> None:
  """Decompresses one chunk into `out` (uint8, exactly the chunk's raw size) or raises."""
  try:
    import blosc2  # pylint: disable=import-outside-toplevel
    kwargs = {"nthreads": threads} if threads else {}
    n = blosc2.decompress2(memoryview(data), dst=out, **kwargs)
    got = out.nbytes if n is None else n
  except CodecError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (each library has its own error types)
    raise CodecError(f"{codec_name} could not decode a chunk: {type(e).__name__}: {e}") from e
  if got != out.nbytes:
    raise CodecError(f"{codec_name} decoded {got} bytes where {out.nbytes} were announced")


@dataclasses.dataclass
class PackedArray:
  """One array, compressed: `codec` names how its chunks decode."""

  codec: str  # Codec.name
  dtype: np.dtype  # the dtype itself: ml_dtypes' bfloat16 has no faithful string form
  shape: tuple[int, ...]
  crc32: int
  chunks: list[np.ndarray]  # compressed, uint8

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

  @property
  def wire_bytes(self) -> int:
    return sum(c.nbytes for c in self.chunks)


def pack_array(codec: Codec, array: np.ndarray) -> PackedArray:
  # Bytes through a uint8 view: the buffer protocol has no format for ml_dtypes' bfloat16.
  data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
  chunks = [np.frombuffer(compress(codec, data[i:i + CHUNK_BYTES], array.itemsize),
                          dtype=np.uint8)
            for i in range(0, data.nbytes, CHUNK_BYTES)]
  return PackedArray(codec.name, array.dtype, tuple(array.shape), zlib.crc32(data), chunks)


def check_decodable(codec_name: str) -> None:
  """Raises CodecError unless this process can decode `codec_name` (before any wait)."""
  if codec_name not in CODECS:
    raise CodecError(f"unknown codec {codec_name!r}; accepted: {', '.join(CODECS)}")
  if not installed(codec_name):
    raise CodecError(f"codec {codec_name} is not installed on the trainer ({extra_hint()})")


def unpack_array(p: PackedArray, *, threads: int = 0, name: str = "array",
                 pool: Any = None) -> np.ndarray:
  """The array, decoded into an aligned buffer (from `pool` when given) and checked; raises
  CodecError otherwise."""
  check_decodable(p.codec)
  buf = wire.aligned_empty(p.nbytes) if pool is None else pool.take(p.nbytes)
  starts = range(0, p.nbytes, CHUNK_BYTES)
  if len(p.chunks) != len(starts):
    raise CodecError(f"{name}: {len(p.chunks)} chunk(s) where {len(starts)} were expected")
  for start, chunk in zip(starts, p.chunks):
    decompress_into(p.codec, chunk, buf[start:start + CHUNK_BYTES], threads)
  if zlib.crc32(buf) != p.crc32:
    raise CodecError(f"{name}: crc32 of the decoded bytes differs from the sender's")
  return buf.view(p.dtype).reshape(p.shape)


# ---------------------------------------------------------------- a payload's pytree


def _map_leaves(fn: Callable[[Any], Any], tree: Any) -> Any:
  """`fn` over every leaf of `tree`, looking inside dataclass leaves: tunix's TrainerPayload
  types (e.g. RLTrainerPayload, what MaxText's engine trains on) are dataclasses but not
  pytrees, so each is copied with its fields mapped. JAX is imported here: a payload is a JAX
  host's, and the rest of the codec needs none."""
  import jax  # pylint: disable=import-outside-toplevel

  def leaf(x: Any) -> Any:
    if (dataclasses.is_dataclass(x) and not isinstance(x, (type, PackedArray))):
      out = copy.copy(x)
      for field in dataclasses.fields(x):
        object.__setattr__(out, field.name, _map_leaves(fn, getattr(x, field.name)))
      return out
    return fn(x)

  return jax.tree.map(leaf, tree)


def compress_payload(codec: Codec, payload: Any) -> CompressedPayload:
  """Runs off the event loop: it copies device arrays to host and compresses them."""
  import jax  # pylint: disable=import-outside-toplevel  (see _map_leaves)
  sizes = [0, 0]

  def leaf(x: Any) -> Any:
    if not isinstance(x, (np.ndarray, jax.Array)):
      return x
    sizes[0] += x.nbytes
    if x.nbytes < MIN_PACK_BYTES:
      sizes[1] += x.nbytes
      return x
    packed = pack_array(codec, np.asarray(x))
    sizes[1] += packed.wire_bytes
    return packed

  tree = _map_leaves(leaf, payload)
  return CompressedPayload(codec.name, tree, *sizes)


def check_payload(payload: CompressedPayload) -> Any:
  """Raises codec.CodecError when this process cannot decode it; answers the tree to check."""
  check_decodable(payload.codec)
  return payload.tree


def decompress_payload(payload: CompressedPayload) -> Any:
  """The payload's pytree with numpy arrays again; raises codec.CodecError for damaged bytes."""
  check_payload(payload)
  return _map_leaves(
      lambda x: unpack_array(x) if isinstance(x, PackedArray) else x,
      payload.tree)
