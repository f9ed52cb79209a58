"""What a process that orchestrates runs: its calls to a trainer (a stage, a train, a reset, the
reference model's log-probs), each over one connection per trainer handle.

A call that may carry a micro-batch is encoded out of band once (transport/wire.py: no copy) and
its transport chosen once (`Connection.route`): the bulk side channel where the trainer offers one
this process reaches and enough bytes travel out of band (asked once per trainer), the chunked
stream where the call is over tunix's message cap, else tunix's own call, byte for byte. A train
by key carries no micro-batch: it is tunix's own `train_step`. A trainer's error becomes the
plugin's typed error through the one map (contract.typed_errors). `StagingCalls` are these calls
as core.pipeline drives them. Made by the installation on the first call an engine of this process
sends. docs/design.md "A micro-batch's way"; docs/tunix.md "Which path a call takes".
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import weakref
from typing import Any, Iterator

import grpc
from tunix.experimental.common import datatypes
from tunix.experimental.worker import remote_execution

from tunix_stage_plugin.core import codec_spec
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import figures
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.transport import sender as sender_lib
from tunix_stage_plugin.transport import wire

log = logging.getLogger("tunix_stage_plugin")

ACTOR = datatypes.Role.ACTOR
MIB = wire.MIB
# The staged loop's reset deadline: a trainer answers a reset at once, off its lanes, so a reset
# that waited tunix's whole call deadline on a stopped trainer would only delay the job's failure
# (~20 s on tunix's 60 s default). A failed reset is kept and retried before the next step.
RESET_TIMEOUT_S = 3.0
# Calls carrying at least this many out-of-band bytes use the side channel (below it, tunix's
# own call costs less than the header's extra round trip).
SIDE_MIN_BYTES = 1 << 20
# A send that broke leaves the header's call this long to bring its own answer (a refusal).
SEND_FAILURE_GRACE_S = 1.0
# The trainer's announced bulk port must accept a connection within this, or calls take tunix's
# port (the chunked stream over the cap, tunix's own call below it).
REACH_TIMEOUT_S = 5.0


class PayloadOverCap(RuntimeError):
  """A call over tunix's message cap met a trainer that cannot take it in chunks; one line."""


class SideChannelError(ConnectionError):
  """The side channel broke while a call's bytes were being sent; one line."""


def message_cap() -> int:
  """tunix's cap on one message, read at call time (as tunix's `_grpc_options` reads it)."""
  return remote_execution._MAX_MESSAGE_BYTES  # pylint: disable=protected-access


def address_of(handle: Any) -> str:
  """HOST:PORT, what tunix's handle dials (it strips the same scheme)."""
  return handle.target_address.replace("grpc://", "", 1)


@dataclasses.dataclass(frozen=True)
class Route:
  """How one call travels: its transport and its out-of-band encoding (None where the call is
  tunix's own and was not encoded)."""

  method: str
  transport: str
  encoded: wire.EncodedRequest | None


class Connection:
  """One trainer handle as this process reaches it: whether it has a side channel (asked once,
  also under concurrent first calls), the side channel's sender, the stream's channel, and what
  each transport carried."""

  def __init__(self, handle: Any, recorder: recorder_lib.Recorder) -> None:
    self.handle = handle
    self._recorder = recorder
    # Only tunix's gRPC handle has a cap and a side channel (the real type: tests bind mocks).
    self._grpc = issubclass(type(handle), remote_execution.GrpcRemoteActorHandle)
    self.address = address_of(handle) if self._grpc else None
    self._sender: sender_lib.BulkSender | None = None
    self._asked = False
    self._lock: asyncio.Lock | None = None
    self._loop: asyncio.AbstractEventLoop | None = None  # the loop the lock and channel are on
    self._channel: Any = None
    self.calls: collections.Counter[str] = collections.Counter()
    self.bytes: collections.Counter[str] = collections.Counter()

  async def route(self, method: str, kwargs: dict[str, Any], *, carries_batch: bool = True
                  ) -> Route:
    """The transport that takes `method(**kwargs)`: the first that fits of the side channel, the
    chunked stream, tunix's own call. Only tunix's gRPC handle has a cap and a side channel; a
    call that carries no micro-batch (a train by key) is tunix's own."""
    if not carries_batch or not self._grpc:
      return Route(method, contract.UNARY, None)
    try:
      encoded = wire.encode(None, method, (), kwargs)  # the tuple tunix's request pickles
    except Exception:  # pylint: disable=broad-except  (it does not pickle: tunix's call says so)
      return Route(method, contract.UNARY, None)
    cap = message_cap()
    if (encoded.out_of_band_bytes >= SIDE_MIN_BYTES
        and len(encoded.body) <= wire.HEADER_BODY_MAX and await self._offered(cap)):
      return Route(method, contract.SIDE_CHANNEL, encoded)
    if encoded.over(cap):
      return Route(method, contract.STREAM, encoded)
    return Route(method, contract.UNARY, encoded)

  @contextlib.contextmanager
  def sending(self, route: Route) -> Iterator[None]:
    """Around the call's send (its step's, where the pipeline's call made it): timed, and
    counted by transport."""
    call = recorder_lib.CALL.get()
    nbytes = None if route.encoded is None else route.encoded.nbytes
    with self._recorder.span(tracks.ORCHESTRATOR_SEND, route.method, transport=route.transport,
                             bytes=nbytes, step=None if call is None else call[0]):
      yield
    if route.transport != contract.UNARY:
      self.calls[route.transport] += 1
      self.bytes[route.transport] += nbytes

  async def send(self, route: Route) -> Any:
    """Sends a call `route` gave a bulk transport; its result, or the trainer's error as
    contract.RemoteError."""
    if route.transport == contract.SIDE_CHANNEL:
      return await self._send_side(route.encoded)
    return await self._send_stream(route.encoded)

  # ------------------------------------------------------------ the side channel

  async def _offered(self, cap: int) -> bool:
    if self._asked:
      return self._sender is not None
    loop = asyncio.get_running_loop()
    if self._lock is None or self._loop is not loop:  # asyncio locks belong to their loop
      self._lock, self._loop = asyncio.Lock(), loop
    async with self._lock:
      if not self._asked:
        self._sender = await self._ask(cap)
        self._asked = True
    return self._sender is not None

  async def _ask(self, cap: int) -> sender_lib.BulkSender | None:
    try:
      with contract.typed_errors(contract.SIDE_PORT):
        port, limits = wire.read_announcement(await self.handle.asubmit(contract.SIDE_PORT))
    except contract.Unsupported:  # a trainer without the plugin (or staging off)
      log.info("tunix-stage: no side channel on %s (tunix-stage-plugin is not installed there, "
               "or staging is off there): calls over the %d MiB cap use the chunked stream",
               self.address, cap >> 20)
      return None
    host = self.address.rsplit(":", 1)[0].strip("[]")
    sender = sender_lib.BulkSender(host, port, limits=limits)
    try:  # one connection, at once closed: is the port reachable from here at all?
      (await asyncio.wait_for(sender.lease(), REACH_TIMEOUT_S)).end()
    except (OSError, asyncio.TimeoutError) as e:  # e.g. only tunix's own port is open to it
      sender.close()
      log.warning("tunix-stage: the side channel at %s:%d cannot be reached from here (%s): calls "
                  "over the %d MiB cap use the chunked stream", host, port,
                  f"{type(e).__name__}: {e}".rstrip(": "), cap >> 20)
      return None
    log.info("tunix-stage: bulk side channel to %s:%d for micro-batch calls >= %d MiB", host, port,
             SIDE_MIN_BYTES >> 20)
    return sender

  async def _send_side(self, encoded: wire.EncodedRequest) -> Any:
    """The call's header on tunix's call, its bytes on the side channel."""
    transfer = wire.new_transfer_id()
    try:
      return await sender_lib.call_with_bytes(
          self.handle.asubmit(contract.SIDE_CALL,
                              **{contract.SIDE_HEADER: encoded.header(transfer)}),
          self._sender, transfer, encoded.parts, SEND_FAILURE_GRACE_S)
    except OSError as e:
      self._sender.close()  # its idle connections may be as broken: the next call connects anew
      raise SideChannelError(
          f"tunix-stage: the side channel to {self.address} broke while sending "
          f"{encoded.method}'s {encoded.nbytes / MIB:.1f} MiB ({type(e).__name__}: {e})") from None

  # ------------------------------------------------------------ the chunked stream

  async def _send_stream(self, encoded: wire.EncodedRequest) -> Any:
    """The call in chunks on the trainer's own port, sent once the trainer accepted its header."""
    loop = asyncio.get_running_loop()
    if self._channel is None or self._loop is not loop:  # aio channels belong to their loop
      self._loop = loop
      self._channel = grpc.aio.insecure_channel(
          self.address, options=remote_execution._grpc_options())  # pylint: disable=protected-access
    from tunix_stage_plugin.transport import stream  # pylint: disable=import-outside-toplevel
    try:
      response = await stream.send(self._channel, stream.messages(encoded),
                                   self.handle._rpc_timeout_s)  # pylint: disable=protected-access
    except grpc.aio.AioRpcError as e:
      if e.code() == grpc.StatusCode.UNIMPLEMENTED:
        raise PayloadOverCap(over_cap_line(encoded, self.address)) from None
      raise
    return contract.unwrap(remote_execution.ExecutionResponse.deserialize(response))

  async def close(self) -> None:
    """Closes the side channel's idle connections and the stream's channel (on the event loop it
    was made on)."""
    if self._sender is not None:
      self._sender.close()
    channel, loop = self._channel, self._loop
    self._channel = None
    if channel is not None and loop is asyncio.get_running_loop():
      await channel.close()

  def close_sender(self) -> None:
    if self._sender is not None:
      self._sender.close()


def over_cap_line(encoded: wire.EncodedRequest, address: str) -> str:
  return (f"tunix-stage: a {encoded.method} call carrying {encoded.nbytes / MIB:.1f} MiB is over "
          f"tunix's {message_cap() / MIB:.0f} MiB message cap "
          f"(remote_execution._MAX_MESSAGE_BYTES) and the trainer at {address} cannot take it "
          "in chunks (tunix-stage-plugin is not installed there, or staging is off there); set "
          "TUNIX_STAGE_BATCH=stage on both the orchestrator and the trainer")


def _trainer(engine: Any, role: datatypes.Role) -> Any:
  worker = engine._trainer_workers.get(role)  # pylint: disable=protected-access
  if worker is None:  # the same contract (and message) as tunix's train_step
    raise ValueError(f"No trainer worker registered for role {role}")
  return worker


class OrchestratorSide:
  """The orchestrator's side of one installation: a connection per trainer handle, and the calls
  that go through them."""

  def __init__(self, inst: Any) -> None:  # the installation.Installation that makes it
    self.inst = inst
    self.recorder = inst.recorder
    self._lock = threading.Lock()
    self._connections: "weakref.WeakKeyDictionary[Any, Connection]" = (
        weakref.WeakKeyDictionary())

  @property
  def calls(self) -> collections.Counter[str]:
    """The calls each bulk transport carried (contract.SIDE_CHANNEL, contract.STREAM)."""
    return sum((c.calls for c in list(self._connections.values())), collections.Counter())

  @property
  def bytes(self) -> collections.Counter[str]:
    """Their bytes, by transport."""
    return sum((c.bytes for c in list(self._connections.values())), collections.Counter())

  def connection(self, handle: Any) -> Connection:
    with self._lock:
      connection = self._connections.get(handle)
      if connection is None:
        connection = self._connections[handle] = Connection(handle, self.recorder)
      return connection

  async def call(self, engine: Any, worker: Any, method: str, **kwargs: Any) -> Any:
    """tunix's `engine._invoke_worker(worker, method, **kwargs)`, over the transport that takes
    it."""
    connection = self.connection(worker)
    route = await connection.route(method, kwargs)
    with connection.sending(route):
      if route.transport == contract.UNARY:
        return await engine._invoke_worker(worker, method, **kwargs)  # pylint: disable=protected-access
      return await connection.send(route)

  async def stage(self, engine: Any, payload: Any, *, key: str, role: datatypes.Role = ACTOR
                  ) -> contract.StageOutcome:
    """`stage_batch(payload, key)` on the trainer of `role`: its StageOutcome; a trainer that can
    never stage it answers UNSUPPORTED, a failure FAILED; a malformed or reused key raises
    StageKeyError (the caller's bug, not a fallback)."""
    try:
      with contract.typed_errors(contract.STAGE_BATCH):
        response = await self.call(engine, _trainer(engine, role), contract.STAGE_BATCH,
                                   payload=payload, key=key)
    except (PayloadOverCap, contract.Unsupported) as e:  # e.g. no chunked stream there
      return contract.unsupported(key, str(e))
    except RuntimeError as e:  # the trainer's error, or a failure on this side
      return contract.failed(key, f"stage_batch failed on the trainer: {str(e)[:500]}")
    return contract.stage_outcome(response)

  async def train(self, engine: Any, payload: Any, *, stage_key: str | None,
                  apply_optimizer: bool, role: datatypes.Role = ACTOR,
                  accumulate_gradients: bool = True) -> contract.Trained:
    """tunix's `engine.train_step(payload, ...)` (`train_step(None, stage_key=k, ...)` for a
    staged batch), byte for byte, unless its fwd_bwd takes the side channel or the stream: then
    that fwd_bwd goes there with the same keywords, and `update` and the answer are tunix's
    train_step's. Trained.result is that answer; Trained.fallback, for a staged batch, why the
    trainer trained it from its payload."""
    worker = _trainer(engine, role)
    connection = self.connection(worker)
    keyed = {} if stage_key is None else {contract.STAGE_KEY: stage_key}
    with contract.typed_errors(contract.FWD_BWD):
      route = await connection.route(
          contract.FWD_BWD, {"payload": payload, "skip_jit": False, **keyed},
          carries_batch=stage_key is None)
      with connection.sending(route):
        if route.transport == contract.UNARY:
          answer = await engine.train_step(payload, role=role,
                                           accumulate_gradients=accumulate_gradients,
                                           apply_optimizer=apply_optimizer, **keyed)
        else:
          answer = await connection.send(route)
    if route.transport != contract.UNARY and apply_optimizer:  # the rest of tunix's train_step
      step = await engine._invoke_worker(worker, contract.UPDATE)  # pylint: disable=protected-access
      answer = contract.train_step_answer(answer, step, accumulated=accumulate_gradients)
    fallback = (None if stage_key is None else contract.placement_fallback(
        contract.fwd_bwd_response(answer, updated=apply_optimizer)))
    return contract.Trained(answer, fallback=fallback)

  async def reset(self, engine: Any, keys: list[str] | None = None, *,
                  role: datatypes.Role = ACTOR, timeout_s: float | None = None) -> list[str]:
    """Drops staged batches on the trainer (all when `keys` is None); returns the dropped keys.
    `timeout_s` bounds the call (TimeoutError after it); None leaves the handle's own deadline."""
    call = engine._invoke_worker(_trainer(engine, role), contract.RESET_STAGED, keys=keys)  # pylint: disable=protected-access
    if timeout_s is None:
      response = await call
    else:
      try:
        response = await asyncio.wait_for(call, timeout_s)
      except asyncio.TimeoutError:
        raise TimeoutError(f"reset_staged got no answer within {timeout_s:g} s") from None
    return contract.dropped_keys(response)

  async def per_token_logps(self, engine: Any, role: datatypes.Role, items: Any,
                            original: Any) -> Any:
    """tunix's call, unless it carries a micro-batch large enough for the side channel or over
    tunix's message cap: then it goes that way, to the worker tunix's call would reach (an
    inference worker of `role`, else the trainer)."""
    # pylint: disable-next=protected-access
    worker = engine._inference_workers.get(role) or engine._trainer_workers.get(role)
    connection = self.connection(worker)
    route = await connection.route(contract.PER_TOKEN_LOGPS, {"items": items})
    with connection.sending(route):
      if route.transport == contract.UNARY:
        return await original(engine, role, items=items)
      return await connection.send(route)

  async def close_connections(self) -> None:
    """Closes the connections' side-channel sockets and stream channels made on this loop (a
    staged run ends)."""
    with self._lock:
      connections = list(self._connections.values())
    for connection in connections:
      await connection.close()

  def close(self) -> None:
    """The side channels' sockets (the stream channels close with their event loop)."""
    with self._lock:
      connections, self._connections = list(self._connections.values()), (
          weakref.WeakKeyDictionary())
    for connection in connections:
      connection.close_sender()


class StagingCalls:
  """The pipeline's three calls (core.pipeline.StageEngine: stage, train, reset) to the actor's
  trainer of one engine. With a codec (TUNIX_STAGE_CODEC) a stage's payload is compressed on a
  worker thread, never on the event loop; `raw_bytes` / `sent_bytes` count its array bytes before
  and after."""

  def __init__(self, side: OrchestratorSide, engine: Any, codec: str = codec_spec.OFF) -> None:
    self._side = side
    self._engine = engine
    self.codec: Any = None  # core.codec.Codec, loaded only where a codec is set
    if codec != codec_spec.OFF:
      from tunix_stage_plugin.core import codec as codec_lib  # pylint: disable=import-outside-toplevel
      self.codec = codec_lib.parse(codec)
    self.raw_bytes = self.sent_bytes = 0
    self.auto: Any = None  # core.sizing.AutoDepth, told each stage's answer (a depth at auto)

  async def stage(self, payload: Any, *, key: str) -> contract.StageOutcome:
    if self.codec is not None:
      from tunix_stage_plugin.core import codec as codec_lib  # pylint: disable=import-outside-toplevel
      payload = await asyncio.to_thread(codec_lib.compress_payload, self.codec, payload)
      self.raw_bytes += payload.nbytes
      self.sent_bytes += payload.wire_bytes
    answer = await self._side.stage(self._engine, payload, key=key)
    if self.auto is not None:  # the trainer's newest step on it
      self.auto.answered(answer)
    return answer

  async def train(self, payload: Any, *, stage_key: str | None, apply_optimizer: bool
                  ) -> contract.Trained:
    return await self._side.train(self._engine, payload, stage_key=stage_key,
                                  apply_optimizer=apply_optimizer)

  async def reset(self, keys: list[str]) -> None:
    # Cleanup, often after a failed call: bounded by a short deadline of its own, never another
    # whole call deadline on a stopped trainer (a failed reset is kept and retried).
    await self._side.reset(self._engine, keys, timeout_s=RESET_TIMEOUT_S)

  def codec_note(self) -> str:
    """The compressed stages so far, for the step's log line ("" without a codec)."""
    if self.codec is None or not self.sent_bytes:
      return ""
    return (f"; codec {self.codec}: staged arrays {figures.size(self.raw_bytes)} sent as "
            f"{figures.size(self.sent_bytes)} (ratio {self.raw_bytes / self.sent_bytes:.2f})")
