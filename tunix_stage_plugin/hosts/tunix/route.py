"""The orchestrator's one decision per call that may carry a micro-batch: which transport takes
it, from its size and what the trainer offers. `Router.call` decides once, sends the call that
way and awaits it; every call of engine.py's goes through it once (a train by key, which carries
no micro-batch, as tunix's own call).

The first that fits: the side channel (side.py), the chunked stream (stream.py), else tunix's own
call, byte for byte. The size is the call's out-of-band encoding (transport/request.py: no copy),
made only for tunix's gRPC handle, the only one with a cap and a side channel. The rules:
docs/tunix.md "Which path a call takes"; docs/design.md "A micro-batch's way".
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Awaitable, Callable

from tunix.experimental.worker import remote_execution

from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import side as side_lib
from tunix_stage_plugin.hosts.tunix import stream as stream_lib
from tunix_stage_plugin.transport import request as request_lib


def _encode(worker: Any, method: str, kwargs: dict[str, Any]
            ) -> request_lib.EncodedRequest | None:
  """The call encoded out of band when `worker` is tunix's gRPC handle; None otherwise, or when
  it does not pickle (tunix's own call reports that)."""
  if not issubclass(type(worker), remote_execution.GrpcRemoteActorHandle):  # the real type
    return None
  try:
    return request_lib.encode(None, method, (), kwargs)  # the tuple tunix's request pickles
  except Exception:  # pylint: disable=broad-except
    return None


class Router:
  """One engine's transports to its trainers: each handle's side channel and stream client, made
  on first use, and what each transport carried (`calls`, `bytes`, by contract.SIDE_CHANNEL and
  contract.STREAM). The program's staged run closes its stream channels when it ends (`close`);
  uninstall closes what is left (`close_sides`)."""

  def __init__(self, recorder: recorder_lib.Recorder = recorder_lib.DISABLED) -> None:
    self._recorder = recorder  # each call's send, by transport (the job's telemetry)
    self._sides: "weakref.WeakKeyDictionary[Any, side_lib.SideChannel]" = (
        weakref.WeakKeyDictionary())
    self._streams: "weakref.WeakKeyDictionary[Any, stream_lib.StreamClient]" = (
        weakref.WeakKeyDictionary())
    self.calls: collections.Counter[str] = collections.Counter()
    self.bytes: collections.Counter[str] = collections.Counter()

  def _side(self, handle: Any) -> side_lib.SideChannel:
    side = self._sides.get(handle)
    if side is None:
      side = self._sides[handle] = side_lib.SideChannel(stream_lib.address_of(handle))
    return side

  def _stream(self, handle: Any) -> stream_lib.StreamClient:
    client = self._streams.get(handle)
    if client is None:
      client = self._streams[handle] = stream_lib.StreamClient(handle)
    return client

  async def _choose(self, worker: Any, encoded: request_lib.EncodedRequest | None) -> str:
    if encoded is None:
      return contract.UNARY
    cap = stream_lib.message_cap()
    if side_lib.wanted(encoded) and await self._side(worker).offered(worker, cap):
      return contract.SIDE_CHANNEL
    if encoded.over(cap):
      return contract.STREAM
    return contract.UNARY

  async def call(self, worker: Any, method: str, kwargs: dict[str, Any],
                 unary: Callable[[], Awaitable[Any]], *, carries_batch: bool = True
                 ) -> tuple[str, Any]:
    """`method(**kwargs)` on the trainer behind `worker`, over the transport that takes it:
    (that transport, the result). `unary()` is tunix's own call for it, and the only way for a
    call that carries no micro-batch (a train by key: nothing to route or count)."""
    if not carries_batch:
      return contract.UNARY, await unary()
    encoded = _encode(worker, method, kwargs)
    transport = await self._choose(worker, encoded)
    if transport == contract.SIDE_CHANNEL:
      send = self._side(worker).send(worker, encoded)
    elif transport == contract.STREAM:
      send = self._stream(worker).send(encoded)
    else:
      send = unary()  # tunix's call pickles it itself: nothing of the encoding is used
    call = recorder_lib.CALL.get()  # the pipeline's call this send belongs to (its step)
    with self._recorder.span(tracks.ORCHESTRATOR_SEND, method, transport=transport,
                             bytes=None if encoded is None else encoded.nbytes,
                             step=None if call is None else call[0]):
      result = await send  # every routed call's send is awaited here, and only here
    if transport != contract.UNARY:
      self.calls[transport] += 1
      self.bytes[transport] += encoded.nbytes
    return transport, result

  def close_sides(self) -> None:
    for side in list(self._sides.values()):
      side.close()

  async def close(self) -> None:
    """Closes the side channels' connections and the stream channels (on the event loop they
    were made on)."""
    self.close_sides()
    for client in list(self._streams.values()):
      await client.close()


def router_of(inst: installation_lib.Installation, engine: Any) -> Router:
  """`engine`'s router, one per DistributedRLEngine and installation."""
  return inst.router_of(engine, lambda: Router(inst.recorder))


async def invoke(engine: Any, router: Router, worker: Any, method: str, **kwargs: Any) -> Any:
  """tunix's `engine._invoke_worker(worker, method, **kwargs)`, over the transport that takes it."""
  _, result = await router.call(
      worker, method, kwargs,
      lambda: engine._invoke_worker(worker, method, **kwargs))  # pylint: disable=protected-access
  return result
