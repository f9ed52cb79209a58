"""How a method call travels between the orchestrator and the trainer.

A call is (method name, args, kwargs) pickled with protocol 5 and `buffer_callback`, so every
numpy array in it travels *out of band* as raw bytes and the pickle itself stays a few hundred
bytes (perf-limits.md §3: in-band pickling costs a copy into fresh memory each way).

- Small calls (out-of-band bytes <= STREAM_THRESHOLD) are re-pickled in band and sent as one unary
  message.
- Larger ones use the client-streaming method: message 0 is the header (method, pickle, buffer
  sizes), then each buffer's bytes as chunks of at most CHUNK_BYTES, never spanning two buffers.
  grpcio's unary path runs at 0.35-0.45 GB/s above ~16 MB and caps a message at 2 GiB, against
  1.1-1.5 GB/s for 4 MiB chunks (perf-limits.md §4).

The receiver copies the chunks into fresh 64-byte-aligned buffers and unpickles against them, so
arrays come back writable and aligned (on CPU, jax.device_put of an aligned buffer is zero-copy).
That copy and the unpickling run on an executor lane, never on the server's event loop.
"""

from __future__ import annotations

import dataclasses
import pickle
import traceback
from typing import Any, Iterator, Sequence

import numpy as np

SERVICE = "tunix_stage.EmbeddedWorker"
CALL = f"/{SERVICE}/Call"
CALL_STREAM = f"/{SERVICE}/CallStream"

CHUNK_BYTES = 4 << 20
STREAM_THRESHOLD = 1 << 20
# One message is at most a chunk, a header or a small call; the cap leaves room for the header but
# refuses the multi-GB single messages this module exists to avoid.
MAX_MESSAGE_BYTES = 16 << 20
ALIGNMENT = 64


def grpc_options() -> list[tuple[str, int]]:
  return [
      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
  ]


class WireError(RuntimeError):
  """A message broke the wire format (sizes, order, or an oversized reply)."""


class RemoteCallError(RuntimeError):
  """The trainer ran the method and it raised; the message names the method and the remote error."""

  def __init__(self, method: str, error_type: str, message: str, remote_traceback: str) -> None:
    super().__init__(f"{method} failed on the trainer: {error_type}: {message}")
    self.method = method
    self.error_type = error_type
    self.remote_traceback = remote_traceback


@dataclasses.dataclass
class EncodedCall:
  method: str
  unary: bytes | None  # the whole call, when small
  header: bytes | None  # the streamed form: header message ...
  buffers: list[memoryview]  # ... then these bytes in chunks

  @property
  def payload_bytes(self) -> int:
    return len(self.unary) if self.unary is not None else sum(b.nbytes for b in self.buffers)


def encode_call(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> EncodedCall:
  buffers: list[pickle.PickleBuffer] = []
  body = pickle.dumps((tuple(args), kwargs), protocol=5, buffer_callback=buffers.append)
  views = [b.raw() for b in buffers]
  if sum(v.nbytes for v in views) <= STREAM_THRESHOLD:
    return EncodedCall(method, pickle.dumps((method, tuple(args), kwargs), protocol=5), None, [])
  header = pickle.dumps({"method": method, "body": body, "sizes": [v.nbytes for v in views]},
                        protocol=5)
  return EncodedCall(method, None, header, views)


def iter_chunks(buffers: Sequence[memoryview], chunk_bytes: int = CHUNK_BYTES
                ) -> Iterator[memoryview]:
  for view in buffers:
    for start in range(0, view.nbytes, chunk_bytes):
      yield view[start:start + chunk_bytes]


def decode_unary(message: bytes) -> tuple[str, tuple, dict]:
  method, args, kwargs = pickle.loads(message)
  return method, args, kwargs


def decode_header(message: bytes) -> dict[str, Any]:
  header = pickle.loads(message)
  if not isinstance(header, dict) or set(header) != {"method", "body", "sizes"}:
    raise WireError("the first message of a streamed call must be its header "
                    "{'method', 'body', 'sizes'}")
  sizes = header["sizes"]
  if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
    raise WireError(f"a streamed call's header must announce its buffer sizes as a list of "
                    f"integers >= 0; got {sizes!r:.80}")
  return header


def announced_bytes(header: dict[str, Any], max_call_bytes: int) -> int:
  """The bytes a streamed call's header announces; refuses more than `max_call_bytes`."""
  total = sum(header["sizes"])
  if total > max_call_bytes:
    raise WireError(f"{header['method']} announces {total} bytes, above this trainer's "
                    f"{max_call_bytes}-byte cap on one call (trainer_main --max_call_mib); "
                    "refused before reading any chunk")
  return total


def overrun_error(method: str, announced: int, received: int) -> WireError:
  return WireError(f"{method} stream carried more than the {announced} bytes its header "
                   f"announced (refused at {received} bytes)")


def aligned_empty(nbytes: int) -> np.ndarray:
  """A writable uint8 buffer whose data starts on a 64-byte boundary."""
  raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
  offset = (-raw.ctypes.data) % ALIGNMENT
  return raw[offset:offset + nbytes]


def assemble(sizes: Sequence[int], chunks: Sequence[bytes]) -> list[np.ndarray]:
  """Copies the received chunks into aligned buffers of the announced sizes (one copy)."""
  out, i = [], 0
  for size in sizes:
    buf = aligned_empty(size)
    filled = 0
    while filled < size:
      if i >= len(chunks):
        raise WireError(f"stream ended after {filled} of {size} bytes of buffer {len(out)}")
      chunk = chunks[i]
      if filled + len(chunk) > size:
        raise WireError(f"a chunk of {len(chunk)} bytes overruns buffer {len(out)} "
                        f"({filled} of {size} bytes filled); chunks never span buffers")
      buf[filled:filled + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
      filled += len(chunk)
      i += 1
    out.append(buf)
  if i != len(chunks):
    raise WireError(f"stream carried {len(chunks) - i} chunk(s) beyond the announced sizes")
  return out


def decode_streamed(header: dict[str, Any], chunks: Sequence[bytes]) -> tuple[tuple, dict]:
  buffers = assemble(header["sizes"], chunks)
  args, kwargs = pickle.loads(header["body"], buffers=buffers)
  return args, kwargs


def encode_reply(result: Any) -> bytes:
  message = pickle.dumps(("ok", result), protocol=5)
  if len(message) > MAX_MESSAGE_BYTES:
    raise WireError(f"reply of {len(message)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte message "
                    "cap; methods return small results")
  return message


def encode_error(error: BaseException) -> bytes:
  tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
  return pickle.dumps(("error", type(error).__name__, str(error), tb), protocol=5)


def decode_reply(method: str, message: bytes) -> Any:
  reply = pickle.loads(message)
  if reply[0] == "ok":
    return reply[1]
  _, error_type, text, tb = reply
  raise RemoteCallError(method, error_type, text, tb)
