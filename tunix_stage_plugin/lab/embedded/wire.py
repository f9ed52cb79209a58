"""How a method call travels between the orchestrator and the trainer.

A call is (method name, args, kwargs) pickled with protocol 5 and `buffer_callback`, so every
numpy array in it travels *out of band* as raw bytes and the pickle itself stays a few hundred
bytes (in-band pickling costs a copy into fresh memory each way; docs/performance.md).

- Small calls (out-of-band bytes <= STREAM_THRESHOLD) are re-pickled in band and sent as one unary
  gRPC message.
- Larger ones send their header (method, pickle, buffer sizes and a fresh transfer id) as one
  unary gRPC message, and the buffers' bytes on the bulk channel (transport/sender.py), straight
  from the arrays' memory, paced in chunks of at most CHUNK_BYTES (the header, its checks and the
  chunks are transport/frames.py's, shared with tunix's host). The trainer receives them into aligned
  buffers (core.buffers) and unpickles over them: the arrays come back writable and aligned with
  no further copy (on CPU, jax.device_put of an aligned buffer is zero-copy). The unpickling runs
  on an executor lane, never on the server's event loop.
"""

from __future__ import annotations

import dataclasses
import pickle
import traceback
from typing import Any, Sequence

import numpy as np

from tunix_stage_plugin.transport import frames

SERVICE = "tunix_stage.EmbeddedWorker"
CALL = f"/{SERVICE}/Call"
CALL_BULK = f"/{SERVICE}/CallBulk"  # a header; its bytes come on the bulk channel
BULK_PORT = f"/{SERVICE}/BulkPort"

CHUNK_BYTES = frames.CHUNK_BYTES  # the emulated link paces the bulk bytes in chunks of this size
STREAM_THRESHOLD = 1 << 20
# One message is a header or a small call; the cap leaves room for a header but refuses the
# multi-GB single messages this module exists to avoid.
MAX_MESSAGE_BYTES = 16 << 20
TRANSFER_ID_BYTES = frames.TRANSFER_ID_BYTES
MAX_BUFFERS = frames.MAX_BUFFERS
WireError = frames.WireError
iter_chunks = frames.iter_chunks
decode_header = frames.decode_header


def grpc_options() -> list[tuple[str, int]]:
  return [
      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
      ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
  ]


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
  header: bytes | None  # the bulk form: the header message ...
  buffers: list[memoryview]  # ... and these bytes, on the bulk channel under `transfer`
  transfer: bytes | None = None

  @property
  def payload_bytes(self) -> int:
    return len(self.unary) if self.unary is not None else sum(b.nbytes for b in self.buffers)


def encode_call(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> EncodedCall:
  buffers: list[pickle.PickleBuffer] = []
  body = pickle.dumps((tuple(args), kwargs), protocol=5, buffer_callback=buffers.append)
  views = [b.raw() for b in buffers]
  if sum(v.nbytes for v in views) <= STREAM_THRESHOLD:
    return EncodedCall(method, pickle.dumps((method, tuple(args), kwargs), protocol=5), None, [])
  transfer = frames.new_transfer_id()
  return EncodedCall(method, None, frames.encode_header(method, body, views, transfer), views,
                     transfer)


def decode_unary(message: bytes) -> tuple[str, tuple, dict]:
  method, args, kwargs = pickle.loads(message)
  return method, args, kwargs


def announced_bytes(header: dict[str, Any], max_call_bytes: int) -> int:
  """The bytes a bulk call's header announces; refuses more than MAX_BUFFERS buffers or more
  than `max_call_bytes` bytes."""
  return frames.announced_bytes(header, max_call_bytes, "trainer_main --max_call_mib")


def decode_bulk(header: dict[str, Any], buffers: Sequence[np.ndarray]) -> tuple[tuple, dict]:
  """The call's arguments, unpickled over the buffers its bytes were received into (no copy)."""
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
