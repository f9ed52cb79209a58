"""The bulk side channel on tunix's host: a micro-batch's bytes beside tunix's gRPC call.

tunix sends a call as one cloudpickled unary message (0.14-0.40 GiB/s at 16-120 MiB measured:
the bytes are copied in and out of pickles and grpc slices), and the chunked stream (stream.py)
moves about 1.5-1.8 GiB/s. The side channel is the transport's (tunix_stage_plugin.transport):
the call's header on tunix's own gRPC call, its arrays' bytes on a plain TCP connection straight
from the arrays' memory into pooled aligned buffers, unpickled over them.

- Trainer: every GrpcRemoteExecutionServer started while staging is installed also runs a
  BulkListener (bound like tunix's server, on every interface) and answers two methods in the
  server's execute_request hook (server.py), before tunix's dispatch: PORT_METHOD (the listener's
  port and the limits it holds a peer to, transport.frames.BulkLimits) and CALL_METHOD (a header:
  checked against the cap before any byte is read, its bytes awaited within the listener's
  limits, then the real method run through execute_request, exactly as a unary call). A server
  without the plugin answers both with tunix's AttributeError. The sender queues its calls within
  the listener's connection cap (transport.sender.Lease).
- Orchestrator: a call to a gRPC trainer handle carrying at least MIN_BYTES out of band goes
  this way when the trainer announced a side channel (asked once per handle; the answer, 'none'
  included, is kept and said in one log line).

docs/tunix.md "Which path a call takes"; docs/security.md "The side channel".
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import traceback
from typing import Any

from tunix.experimental.worker import remote_execution

from tunix_stage_plugin.hosts.tunix import chunked
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.transport import frames
from tunix_stage_plugin.transport import listener as listener_lib
from tunix_stage_plugin.transport import sender as sender_lib

log = logging.getLogger("tunix_stage_plugin")

PORT_METHOD = "tunix_stage_bulk_port"
CALL_METHOD = "tunix_stage_bulk_call"
METHODS = frozenset({PORT_METHOD, CALL_METHOD})
# Calls carrying at least this many out-of-band bytes use the side channel (below it, tunix's
# own call costs less than the header's extra round trip).
MIN_BYTES = 1 << 20
# Where the listener binds: every interface, as tunix's server ("[::]:port"); "0.0.0.0" where
# the machine has no IPv6.
BIND_HOSTS = ("::", "0.0.0.0")
# A send that broke leaves the header's call this long to bring its own answer (a refusal).
SEND_FAILURE_GRACE_S = 1.0
CAP_SETTING = "tunix_stage_plugin.hosts.tunix.installation.MAX_STREAM_BYTES"


class SideChannelError(ConnectionError):
  """The side channel broke while a call's bytes were being sent; one line."""


# ---------------------------------------------------------------- trainer side


def start(inst: installation_lib.Installation, server: Any) -> None:
  """Starts `server`'s listener (its receive buffers are the installation's pool)."""
  transfers = listener_lib.Transfers(inst.bulk_limits)
  for host in BIND_HOSTS:
    listener = listener_lib.BulkListener(inst.pool, transfers, host=host)
    try:
      listener.start()
    except OSError as e:
      log.debug("tunix-stage: the side channel cannot bind %s: %s", host, e)
      continue
    inst.side_channels[server] = installation_lib.SideChannel(listener, transfers)
    return
  log.warning("tunix-stage: no side channel for this server (no address to bind): calls over "
              "the message cap use the chunked stream")


def stop(inst: installation_lib.Installation, server: Any) -> None:
  side = inst.side_channels.pop(server, None)
  if side is not None:
    side.listener.close()


async def answer(inst: installation_lib.Installation, side: installation_lib.SideChannel,
                 server: Any, request: Any) -> Any:
  """Answers PORT_METHOD or CALL_METHOD (tunix's ExecutionResponse); the hook calls it."""
  if request.method_name == PORT_METHOD:  # where the listener is and the bounds it holds a peer to
    return remote_execution.ExecutionResponse(
        result=frames.announcement(side.listener.port, side.transfers.limits),
        request_id=request.request_id)
  try:
    header = frames.decode_header(_header_bytes(request))
    method = header["method"]
    try:
      frames.announced_bytes(header, inst.max_stream_bytes, CAP_SETTING)
    except frames.WireError:
      side.transfers.refuse(header["transfer"])  # its frame is dropped at once
      raise
    # Bounded by the listener's limits (the frame begins within pair_wait_s, no pause longer
    # than stall_s); the transfer ends on every path.
    received = await side.transfers.receive(header["transfer"], header["sizes"])
    buffers = received.buffers
    del received
    request_id, method_name, args, kwargs = pickle.loads(header["body"], buffers=buffers)
    del buffers  # the arrays over them are all that is kept
    if method_name != method:
      raise frames.WireError(f"{method}: the side-channel call's pickle is not a request for the "
                             "method its header names")
    inst.bulk_calls[method] += 1
    inner = remote_execution.ExecutionRequest(request_id=request_id, method_name=method_name,
                                              args=args, kwargs=kwargs)
    del args, kwargs
    return await server.execute_request(inner)  # as a unary call: the executor's lanes
  except Exception as e:  # pylint: disable=broad-except  (travels back, as tunix's handler does)
    return remote_execution.ExecutionResponse(error_message=str(e), error_type=type(e).__name__,
                                              traceback=traceback.format_exc(),
                                              request_id=request.request_id)


def _header_bytes(request: Any) -> bytes:
  if request.args or set(request.kwargs) != {"header"}:
    raise frames.WireError(f"{CALL_METHOD} takes one keyword argument, header (bytes)")
  header = request.kwargs["header"]
  if not isinstance(header, bytes):
    raise frames.WireError(f"{CALL_METHOD}'s header must be bytes; got {type(header).__name__}")
  return header


# ---------------------------------------------------------------- orchestrator side


def wanted(encoded: chunked.EncodedRequest) -> bool:
  """Whether a call goes to the side channel (when its trainer has one): enough bytes out of
  band, and a pickle small enough to travel in the header."""
  return (sum(b.nbytes for b in encoded.buffers) >= MIN_BYTES
          and len(encoded.body) <= chunked.HEADER_BODY_MAX)


def _host(address: str) -> str:
  return address.rsplit(":", 1)[0].strip("[]")


class Channel:
  """One trainer's side channel: asked for once (the answer, a sender or None, is kept)."""

  def __init__(self, address: str) -> None:
    self.address = address
    self.sender: sender_lib.BulkSender | None = None
    self.known = False
    self._lock: asyncio.Lock | None = None
    self._loop: asyncio.AbstractEventLoop | None = None

  async def open(self, worker: Any) -> sender_lib.BulkSender | None:
    """The sender to the trainer's listener, or None when it has none; made once, also under
    concurrent first calls."""
    if self.known:
      return self.sender
    loop = asyncio.get_running_loop()
    if self._lock is None or self._loop is not loop:  # asyncio locks belong to their loop
      self._lock, self._loop = asyncio.Lock(), loop
    async with self._lock:
      if not self.known:
        self.sender = await self._ask(worker)
        self.known = True
    return self.sender

  async def _ask(self, worker: Any) -> sender_lib.BulkSender | None:
    try:
      port, limits = frames.read_announcement(await worker.asubmit(PORT_METHOD))
    except RuntimeError as e:  # tunix's envelope: a trainer without the plugin (or staging off)
      if "[AttributeError]" not in str(e):
        raise
      log.info("tunix-stage: no side channel on %s (tunix-stage-plugin is not installed there, "
               "or staging is off there): calls over the %d MiB cap use the chunked stream",
               self.address, remote_execution._MAX_MESSAGE_BYTES >> 20)  # pylint: disable=protected-access
      return None
    host = _host(self.address)
    log.info("tunix-stage: bulk side channel to %s:%d for micro-batch calls >= %d MiB", host, port,
             MIN_BYTES >> 20)
    return sender_lib.BulkSender(host, port, limits=limits)

  async def call(self, worker: Any, sender: sender_lib.BulkSender,
                 encoded: chunked.EncodedRequest) -> Any:
    """Sends `encoded`'s header on tunix's call and its bytes on the side channel; the result,
    or tunix's RuntimeError envelope for an error on the trainer."""
    transfer = frames.new_transfer_id()
    header = frames.encode_header(encoded.method, encoded.body, encoded.buffers, transfer)
    try:
      return await sender_lib.call_with_bytes(worker.asubmit(CALL_METHOD, header=header), sender,
                                             transfer, encoded.buffers, SEND_FAILURE_GRACE_S)
    except OSError as e:
      sender.close()  # its idle connections may be as broken: the next call connects anew
      raise SideChannelError(
          f"tunix-stage: the side channel to {self.address} broke while sending {encoded.method}'s "
          f"{encoded.nbytes / chunked.MIB:.1f} MiB ({type(e).__name__}: {e})") from None

  def close(self) -> None:
    if self.sender is not None:
      self.sender.close()
