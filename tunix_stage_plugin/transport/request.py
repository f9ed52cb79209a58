"""A call in the form the plugin's transports carry: the request tuple tunix pickles (request id,
method, args, kwargs), pickled with protocol 5 and a `buffer_callback`, so every contiguous array
stays out of band in its own memory and the pickle is a few KiB.

Encoding copies no array byte, so the orchestrator measures every call that may carry a
micro-batch this way before it picks a transport (hosts/tunix/route.py), and the trainer decodes
it over the buffers its bytes were received into. Host-neutral (imports no tunix): tunix's host
and the embedded one both encode with it. docs/design.md "A micro-batch's way".
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Sequence

import cloudpickle

from tunix_stage_plugin.transport import frames

MIB = 1 << 20
# What a call adds to its pickle on tunix's unary path beyond the out-of-band form (each in-band
# buffer's opcode and length, the gRPC message's framing): a call this close to the cap is over it.
CAP_MARGIN = 64 << 10


@dataclasses.dataclass
class EncodedRequest:
  """A call pickled out of band: the small pickle and the buffers its arrays' bytes live in."""

  method: str
  body: bytes
  buffers: list[memoryview]

  @property
  def nbytes(self) -> int:
    """About what tunix's unary message would carry (the pickle plus every buffer's bytes)."""
    return len(self.body) + sum(b.nbytes for b in self.buffers)

  @property
  def out_of_band_bytes(self) -> int:
    return sum(b.nbytes for b in self.buffers)

  def over(self, cap: int) -> bool:
    """Whether tunix's unary path would refuse it (within CAP_MARGIN of `cap` counts as over)."""
    return self.nbytes > cap - CAP_MARGIN

  def header(self, transfer: bytes) -> bytes:
    """Its bulk header (frames.encode_header), its parts to travel under `transfer`."""
    return frames.encode_header(self.method, self.body, self.buffers, transfer)

  @property
  def parts(self) -> list[memoryview]:
    """What its bulk chunks carry (frames.parts)."""
    return frames.parts(self.body, self.buffers)


def encode(request_id: str | None, method_name: str, args: tuple, kwargs: dict[str, Any]
           ) -> EncodedRequest:
  """The request tuple tunix's ExecutionRequest.serialize pickles, pickled out of band.

  Cheap for any payload size: no array byte is copied (contiguous numpy arrays hand their memory
  to `buffer_callback`)."""
  buffers: list[pickle.PickleBuffer] = []
  body = cloudpickle.dumps((request_id, method_name, tuple(args), dict(kwargs)), protocol=5,
                           buffer_callback=buffers.append)
  return EncodedRequest(method_name, body, [b.raw() for b in buffers])


def encode_whole(request_id: str | None, method_name: str, args: tuple, kwargs: dict[str, Any]
                 ) -> bytes:
  """The same tuple with its arrays in band: one message (what tunix's own unary call sends)."""
  return cloudpickle.dumps((request_id, method_name, tuple(args), dict(kwargs)), protocol=5)


def decode(body: Any, buffers: Sequence[Any] = (), method: str | None = None) -> tuple[Any, ...]:
  """The request tuple `body` pickles, its arrays over `buffers`; WireError unless it is a request
  (for `method`, when a header named one)."""
  request = pickle.loads(body, buffers=buffers)
  if not (isinstance(request, tuple) and len(request) == 4
          and (request[1] == method if method is not None else isinstance(request[1], str))):
    raise frames.WireError(f"{method}: the call's pickle is not a request for the method its "
                           "header names" if method is not None else
                           "a call's message is not a request (request_id, method, args, kwargs)")
  return request


def decode_received(header: frames.Header, buffers: list[Any]) -> tuple[Any, ...]:
  """The request a bulk call carried, over the buffers its parts were received into."""
  if header.body is None:  # the pickle came as the first part
    return decode(buffers[0], buffers[1:], header.method)
  return decode(header.body, buffers, header.method)
