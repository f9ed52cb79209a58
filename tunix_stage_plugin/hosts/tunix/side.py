"""The bulk side channel on tunix's host, both ends: a call's header on tunix's own gRPC call, its
arrays' bytes beside it on the transport's bulk channel (tunix_stage_plugin.transport).

Why: tunix's unary call copies every byte in and out of pickles and gRPC slices; the bulk channel
sends the arrays from their own memory into the trainer's pooled aligned buffers. Trainer: a
BulkListener beside each GrpcRemoteExecutionServer (`listen`), whose server answers the two
contract.SIDE_METHODS before tunix's dispatch (`answer`, handing the call to lanes.Lanes.answer).
Orchestrator: `SideChannel` asks a trainer once for its port and sends the calls route.py gives it.
docs/tunix.md "Which path a call takes"; docs/security.md "Where the trust boundary is".
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tunix.experimental.worker import remote_execution

from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import lanes as lanes_lib
from tunix_stage_plugin.transport import frames
from tunix_stage_plugin.transport import listener as listener_lib
from tunix_stage_plugin.transport import request as request_lib
from tunix_stage_plugin.transport import sender as sender_lib

log = logging.getLogger("tunix_stage_plugin")

# Calls carrying at least this many out-of-band bytes use the side channel (below it, tunix's
# own call costs less than the header's extra round trip).
MIN_BYTES = 1 << 20
# Where the listener binds: every interface, as tunix's server ("[::]:port"); "0.0.0.0" where
# the machine has no IPv6.
BIND_HOSTS = ("::", "0.0.0.0")
# A send that broke leaves the header's call this long to bring its own answer (a refusal).
SEND_FAILURE_GRACE_S = 1.0
# The trainer's announced bulk port must accept a connection within this, or calls take tunix's
# port (the chunked stream over the cap, tunix's own call below it).
REACH_TIMEOUT_S = 5.0


class SideChannelError(ConnectionError):
  """The side channel broke while a call's bytes were being sent; one line."""


# ---------------------------------------------------------------- trainer side


def listen(inst: installation_lib.Installation, server: Any) -> None:
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
  """Answers contract.SIDE_PORT or SIDE_CALL (tunix's ExecutionResponse); server.py calls it."""
  if request.method_name == contract.SIDE_PORT:  # where the listener is, the bounds it holds
    return remote_execution.ExecutionResponse(
        result=frames.announcement(side.listener.port, side.transfers.limits),
        request_id=request.request_id)

  async def receive() -> tuple[frames.Header, frames.Received]:
    header = frames.decode_header(_header_bytes(request))
    try:
      frames.announced_bytes(header, inst.max_stream_bytes, lanes_lib.CAP_SETTING)
    except frames.WireError:
      side.transfers.refuse(header.transfer)  # its frame is dropped at once
      raise
    # Bounded by the listener's limits (the frame begins within pair_wait_s, no pause longer
    # than stall_s); the transfer ends on every path.
    received = await side.transfers.receive(header.transfer, header.sizes)
    inst.bulk_calls[header.method] += 1
    return header, received

  return await inst.lanes.answer(server, contract.SIDE_CHANNEL, receive, request.request_id)


def _header_bytes(request: Any) -> bytes:
  if request.args or set(request.kwargs) != {contract.SIDE_HEADER}:
    raise frames.WireError(f"{contract.SIDE_CALL} takes one keyword argument, "
                           f"{contract.SIDE_HEADER} (bytes)")
  header = request.kwargs[contract.SIDE_HEADER]
  if not isinstance(header, bytes):
    raise frames.WireError(f"{contract.SIDE_CALL}'s header must be bytes; got "
                           f"{type(header).__name__}")
  return header


# ---------------------------------------------------------------- orchestrator side


def wanted(encoded: request_lib.EncodedRequest) -> bool:
  """Whether a call goes to the side channel (when its trainer has one): enough bytes out of
  band, and a pickle small enough to travel in the header."""
  return (encoded.out_of_band_bytes >= MIN_BYTES
          and len(encoded.body) <= frames.HEADER_BODY_MAX)


def _host(address: str) -> str:
  return address.rsplit(":", 1)[0].strip("[]")


class SideChannel:
  """One trainer's side channel, as the orchestrator sees it: asked for once (`offered`; the
  answer, a sender or none, is kept), then each call's header and bytes sent together (`send`)."""

  def __init__(self, address: str) -> None:
    self.address = address
    self._sender: sender_lib.BulkSender | None = None
    self._known = False
    self._lock: asyncio.Lock | None = None
    self._loop: asyncio.AbstractEventLoop | None = None

  async def offered(self, worker: Any, cap: int) -> bool:
    """Whether the trainer behind `worker` has a side channel this process reaches; asked once,
    also under concurrent first calls (`cap`: tunix's message cap, for the log line)."""
    if self._known:
      return self._sender is not None
    loop = asyncio.get_running_loop()
    if self._lock is None or self._loop is not loop:  # asyncio locks belong to their loop
      self._lock, self._loop = asyncio.Lock(), loop
    async with self._lock:
      if not self._known:
        self._sender = await self._ask(worker, cap)
        self._known = True
    return self._sender is not None

  async def _ask(self, worker: Any, cap: int) -> sender_lib.BulkSender | None:
    try:
      with contract.typed_errors(contract.SIDE_PORT):
        port, limits = frames.read_announcement(await worker.asubmit(contract.SIDE_PORT))
    except contract.Unsupported:  # a trainer without the plugin (or staging off)
      log.info("tunix-stage: no side channel on %s (tunix-stage-plugin is not installed there, "
               "or staging is off there): calls over the %d MiB cap use the chunked stream",
               self.address, cap >> 20)
      return None
    host = _host(self.address)
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
             MIN_BYTES >> 20)
    return sender

  async def send(self, worker: Any, encoded: request_lib.EncodedRequest) -> Any:
    """Sends `encoded`'s header on tunix's call and its bytes on the side channel (once
    `offered`); the result, or the trainer's error in tunix's envelope (contract.typed_error
    maps it)."""
    assert self._sender is not None, "send only once the trainer offered a side channel"
    transfer = frames.new_transfer_id()
    try:
      return await sender_lib.call_with_bytes(
          worker.asubmit(contract.SIDE_CALL, **{contract.SIDE_HEADER: encoded.header(transfer)}),
          self._sender, transfer, encoded.parts, SEND_FAILURE_GRACE_S)
    except OSError as e:
      self._sender.close()  # its idle connections may be as broken: the next call connects anew
      raise SideChannelError(
          f"tunix-stage: the side channel to {self.address} broke while sending {encoded.method}'s "
          f"{encoded.nbytes / request_lib.MIB:.1f} MiB ({type(e).__name__}: {e})") from None

  def close(self) -> None:
    if self._sender is not None:
      self._sender.close()
