"""The orchestrator's end of the bulk channel: a call's bytes sent from the arrays' own memory on
connections leased within the listener's limits, beside the call's header (docs/embedded.md "The
bulk channel").

`call_with_bytes` is the one way a bulk call goes out, and its invariants live here: a refusal by
the header ends the send; a send that broke leaves the call a grace period to bring its own
answer, then its error is the call's; whatever ends the call, both halves are cancelled and
awaited and the lease ended, so no send outlives its call and a half-sent frame's connection is
closed, never reused.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

from tunix_stage_plugin.transport import wire

IDLE_KEPT = 4  # a sender keeps at most this many idle connections for reuse

# How a frame's bytes are handed to the socket, chunk by chunk. `frame_chunks` hands them at once,
# CHUNK_BYTES at a time; an emulated link (the lab's, lab/embedded/pacing.py) paces them instead.
Chunks = Callable[[Sequence[memoryview]], AsyncIterator[memoryview]]


async def frame_chunks(buffers: Sequence[memoryview]) -> AsyncIterator[memoryview]:
  for chunk in wire.iter_chunks(buffers):
    yield chunk


class Lease:
  """One connection a sender holds for one frame, and its slot within the listener's cap.

  `sent` gives the connection back once its frame went out: idle for the next frame (its slot
  free at once) or closed. A closed one's slot stays taken until `end` (the call has its answer):
  until then the listener may still count the connection, its thread waiting for the call's
  header to claim the frame already sent."""

  __slots__ = ("sock", "_give_back", "_release", "_connection_back", "_slot_back")

  def __init__(self, sock: socket.socket, give_back: Callable[[socket.socket, bool], bool],
               release: Callable[[], None]) -> None:
    self.sock = sock
    self._give_back = give_back  # (connection, whole frame sent) -> kept idle for reuse
    self._release = release  # frees the slot
    self._connection_back = False
    self._slot_back = False

  def sent(self, whole: bool) -> None:
    """The frame went out (`whole`) or not (the connection then closes)."""
    if not self._connection_back:
      self._connection_back = True
      if self._give_back(self.sock, whole):
        self._free_slot()

  def end(self) -> None:
    """The call is over, whatever happened: its connection and slot are back."""
    self.sent(False)
    self._free_slot()

  def _free_slot(self) -> None:
    if not self._slot_back:
      self._slot_back = True
      self._release()


class BulkSender:
  """Frames to one listener, sent on connections leased within its `limits` (a call waits for one
  when all are in use), from the arrays' own memory. A connection is reused only after a whole
  frame went out."""

  def __init__(self, host: str, port: int, limits: wire.BulkLimits = wire.BulkLimits()
               ) -> None:
    self._address = (host, port)
    self.limits = limits
    self._slots = asyncio.Semaphore(limits.max_connections)
    self._idle: list[tuple[socket.socket, float]] = []  # (connection, idle since)
    self._waiting = 0  # calls waiting for a slot
    self.sent_bytes = 0  # the buffers' bytes handed to the kernel, frames' headers excluded

  async def lease(self) -> Lease:
    """A connection for one frame: an idle one, or a new one the listener accepted. Raises
    WireError, naming the cap, when the listener refuses a new one. The caller ends the lease
    (`Lease.end`) once its call is over."""
    self._waiting += 1
    try:
      await self._slots.acquire()
    finally:
      self._waiting -= 1
    try:
      sock = self._reusable() or await self._connect()
    except BaseException:
      self._slots.release()
      raise
    return Lease(sock, self._keep_idle, self._slots.release)

  def _reusable(self) -> socket.socket | None:
    """The most recent idle connection still well inside the listener's header wait; older or
    closed ones are closed."""
    now, fresh = time.monotonic(), []
    for sock, since in self._idle:
      if now - since < self.limits.header_wait_s / 2 and not wire.hung_up(sock):
        fresh.append((sock, since))
      else:
        sock.close()
    self._idle = fresh
    return self._idle.pop()[0] if self._idle else None

  async def _connect(self) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket(wire.family(self._address[0]), socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
      await loop.sock_connect(sock, self._address)
      answer = await loop.sock_recv(sock, wire.MAX_REFUSAL_BYTES)
      if answer != wire.ACCEPTED:
        while answer[:1] == wire.REFUSED and len(answer) < wire.MAX_REFUSAL_BYTES:
          more = await loop.sock_recv(sock, wire.MAX_REFUSAL_BYTES - len(answer))
          if not more:
            break
          answer += more
        why = (answer[1:].decode(errors="replace") if answer[:1] == wire.REFUSED else
               f"it answered {answer[:16]!r} where {wire.ACCEPTED!r} accepts")
        raise wire.WireError(f"the trainer's bulk listener at {self._address[0]}:"
                               f"{self._address[1]} refused a connection: {why}")
    except BaseException:
      sock.close()
      raise
    return sock

  def _keep_idle(self, sock: socket.socket, whole: bool) -> bool:
    """Keeps a connection whose whole frame went out for the next frame (always while calls
    wait for a slot, so one of them takes it instead of connecting anew; else up to IDLE_KEPT);
    closes it otherwise."""
    if whole and (self._waiting or len(self._idle) < IDLE_KEPT):
      self._idle.append((sock, time.monotonic()))
      return True
    sock.close()
    return False

  async def send(self, lease: Lease, transfer_id: bytes, buffers: Sequence[memoryview],
                 chunks: Chunks | None = None) -> None:
    """Sends one frame on `lease`'s connection, its bytes as `chunks` hands them (`frame_chunks`
    when None), then gives the connection back (`Lease.sent`)."""
    loop = asyncio.get_running_loop()
    whole = False
    try:
      await loop.sock_sendall(lease.sock, wire.frame_header(transfer_id,
                                                              [b.nbytes for b in buffers]))
      async for chunk in (chunks or frame_chunks)(buffers):
        await loop.sock_sendall(lease.sock, chunk)
        self.sent_bytes += chunk.nbytes
      whole = True
    finally:
      lease.sent(whole)

  def close(self) -> None:
    idle, self._idle = self._idle, []
    for sock, _ in idle:
      sock.close()


async def call_with_bytes(rpc: Awaitable[Any], sender: BulkSender, transfer: bytes,
                          buffers: Sequence[memoryview], grace_s: float,
                          chunks: Chunks | None = None) -> Any:
  """Awaits `rpc` (the header's call, started once a connection is held) while `sender` sends
  `buffers` under `transfer` (as `chunks` hands them)."""
  try:
    lease = await sender.lease()
  except BaseException:
    if asyncio.iscoroutine(rpc):
      rpc.close()  # never started
    else:
      asyncio.ensure_future(rpc).cancel()
    raise
  call = asyncio.ensure_future(rpc)
  send = asyncio.ensure_future(sender.send(lease, transfer, buffers, chunks))
  try:
    await asyncio.wait({call, send}, return_when=asyncio.FIRST_COMPLETED)
    if not call.done() and send.exception() is not None:
      await asyncio.wait({call}, timeout=grace_s)
      if not call.done():
        raise send.exception()
    return await call
  finally:
    for task in (call, send):
      task.cancel()
    await asyncio.gather(call, send, return_exceptions=True)
    lease.end()
