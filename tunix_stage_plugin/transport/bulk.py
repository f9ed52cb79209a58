"""The bulk byte channel of both hosts: a call's array bytes on a plain TCP connection.

Why not gRPC for the bytes: grpcio's Python path copies every byte twice on each side (into and
out of its slices) and pays a Python message per chunk, about 0.5-1 GiB/s on this project's
2-core machines, while a socket sends the arrays from the caller's own memory and receives them
straight into the aligned buffer that is placed: one kernel copy per side, 2.5-4 GiB/s
(docs/performance.md). The call itself (method, pickle, sizes, deadline, liveness, errors) stays
on gRPC; only the bytes travel here, keyed by the 128-bit transfer id the call's header carries.
(Newer tunix took the same route: a bulk TCP side channel next to its gRPC service.)

A connection opens with one byte from the listener (ACCEPTED), or a refusal (REFUSED and why)
before it closes; then frames follow, each MAGIC, the transfer id (16 bytes), the buffer count
(u32) and sizes (u64 each), then the buffers' bytes in order. The listener binds where its host
says (the embedded trainer: 127.0.0.1; tunix's trainer: where tunix's server listens), never
unpickles, and fills buffers only for a transfer a gRPC call has announced (and whose sizes
passed that call's cap). Every wait on a peer is bounded by `BulkLimits`, the one place its rules
live (the listener enforces them, the sender learns them from the BulkPort answer): connections,
a frame header's wait, the pairing of a frame with its call's header, and a pause in a frame's
bytes. docs/embedded.md "The bulk channel" and "Limits of the bulk channel", docs/tunix.md.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import pickle
import select
import socket
import struct
import threading
import time
from typing import Protocol, Sequence

import numpy as np

from tunix_stage_plugin.core import buffers as buffers_lib
from tunix_stage_plugin.transport import frames as wire

log = logging.getLogger("tunix_stage_plugin.transport")

MAGIC = b"TSB1"
HEADER = struct.Struct(f"<4s{wire.TRANSFER_ID_BYTES}sI")  # magic, transfer id, buffer count
ACCEPTED = b"+"  # the listener's first byte on a connection it serves
REFUSED = b"-"  # ... or this, then why (UTF-8), then it closes
MAX_REFUSAL_BYTES = 1024
RECV_BYTES = 16 << 20  # one recv_into asks for at most this much
REMEMBERED = 4096  # ended transfer ids remembered, so a late frame for one is dropped at once
IDLE_KEPT = 4  # a sender keeps at most this many idle connections for reuse
# A paced chunk takes at most this much of its link's time, so even the cap's worth of calls
# sharing a slow emulated link pause each frame far less than stall_s (at most 10 chunks a second
# a link, however slow).
PACED_CHUNK_S = 0.1
STOPPING = "the trainer is stopping: its bulk listener closed before this call's bytes arrived"


@dataclasses.dataclass(frozen=True)
class BulkLimits:
  """What the listener allows a peer; the sender lives within it (docs/embedded.md "Limits of the
  bulk channel"). A peer that breaks a bound loses its connection; the call it carried, if any,
  fails with a WireError naming the bound."""

  # Connections open at once (one thread each); one more is refused with a message. A sender
  # queues its own sends within this, so only several clients together reach it.
  max_connections: int = 32
  # A connection's next frame header (all of it) must arrive within this of the connection's
  # opening or of its previous frame's end. A sender reuses a connection idle for less than half.
  header_wait_s: float = 5.0
  # A frame waits this long for the gRPC header of its call, and a call's header this long for its
  # frame to begin (they are sent together: milliseconds).
  pair_wait_s: float = 10.0
  # A frame's bytes must keep coming: a pause this long fails its call. A paced sender's chunks
  # take at most PACED_CHUNK_S of link time each, so a slow emulated link never pauses this long.
  stall_s: float = 10.0


def announcement(port: int, limits: BulkLimits) -> bytes:
  """The BulkPort answer: where the listener is and the limits it enforces."""
  return pickle.dumps({"port": port, "limits": limits}, protocol=5)


def read_announcement(message: bytes) -> tuple[int, BulkLimits]:
  answer = pickle.loads(message)
  return answer["port"], answer["limits"]


@dataclasses.dataclass
class Received:
  """A transfer's bytes, in the buffers they were received into, and when they arrived."""

  buffers: list[np.ndarray]
  started: float  # perf_counter: the frame's header was read (its call announced)
  ended: float  # the last byte was read


class _Transfer:
  __slots__ = ("sizes", "future", "claimed", "connection")

  def __init__(self, sizes: list[int]) -> None:
    self.sizes = sizes
    self.future: concurrent.futures.Future = concurrent.futures.Future()
    self.claimed = False
    self.connection: socket.socket | None = None  # the one receiving its bytes, once claimed


class Transfers:
  """Transfer ids announced by gRPC calls, matched with the frames that carry their bytes.

  Only the call that announced an id ends it (`receive`); a header refused before that marks an
  id nobody holds as ended (`refuse`), so its frame is dropped at once, and never touches an id
  another call holds."""

  def __init__(self, limits: BulkLimits = BulkLimits()) -> None:
    self.limits = limits
    self._cond = threading.Condition()
    self._open: dict[bytes, _Transfer] = {}
    self._ended: collections.OrderedDict[bytes, None] = collections.OrderedDict()
    self._closed = False

  def close(self) -> None:
    """No frame is claimed any more (the listener is stopping): waiting frames are dropped, and a
    call still waiting for its frame to begin fails."""
    with self._cond:
      self._closed = True
      waiting = [t for t in self._open.values() if not t.claimed]
      self._cond.notify_all()
    for transfer in waiting:
      _fail(transfer, wire.WireError(STOPPING))

  def expect(self, transfer_id: bytes, sizes: list[int]) -> concurrent.futures.Future:
    """Called for a call's header: its bytes will arrive under `transfer_id`."""
    with self._cond:
      if self._closed:
        raise wire.WireError(STOPPING)
      if transfer_id in self._open or transfer_id in self._ended:
        raise wire.WireError("a bulk transfer id was used twice; ids are single-use")
      transfer = self._open[transfer_id] = _Transfer(list(sizes))
      self._cond.notify_all()
      return transfer.future

  def end(self, transfer_id: bytes) -> None:
    """The call is over (answered, refused or cancelled): a frame for it is dropped."""
    with self._cond:
      transfer = self._open.pop(transfer_id, None)
      self._remember(transfer_id)
      self._cond.notify_all()
    if transfer is not None:
      transfer.future.cancel()  # no-op once received
      if transfer.connection is not None and transfer.future.cancelled():
        _shutdown(transfer.connection)  # its bytes were still coming: their buffers go back now

  def refuse(self, transfer_id: bytes) -> None:
    """A header refused before it announced its id: a frame for it is dropped at once. An id
    another call holds is left alone."""
    with self._cond:
      if transfer_id not in self._open:
        self._remember(transfer_id)
        self._cond.notify_all()

  async def receive(self, transfer_id: bytes, sizes: list[int]) -> Received:
    """The bytes a call's header announced. Its frame must begin within `pair_wait_s`; the
    listener bounds the rest. The transfer is ended on every path."""
    future = self.expect(transfer_id, sizes)  # an id in use is refused here, untouched
    try:
      arrival = asyncio.wrap_future(future)
      await asyncio.wait({arrival}, timeout=self.limits.pair_wait_s)
      if not arrival.done() and self._give_up(transfer_id):
        raise wire.WireError(
            f"no bulk frame for this call began within {self.limits.pair_wait_s:g} s of its "
            "header (BulkLimits.pair_wait_s): its bytes never arrived on the bulk channel")
      return await arrival
    finally:
      self.end(transfer_id)

  def _give_up(self, transfer_id: bytes) -> bool:
    """True when the transfer was not claimed by a frame; it can no longer be."""
    with self._cond:
      transfer = self._open.get(transfer_id)
      if transfer is None or transfer.claimed:
        return False
      transfer.claimed = True
      return True

  def _remember(self, transfer_id: bytes) -> None:
    self._ended[transfer_id] = None
    while len(self._ended) > REMEMBERED:
      self._ended.popitem(last=False)

  def claim(self, transfer_id: bytes, connection: socket.socket | None = None
            ) -> _Transfer | str:
    """For a frame's header: the announced transfer, or why the frame is not wanted. Waits at
    most `pair_wait_s` for the call's header. A call that ends before its bytes are in shuts
    `connection` down (the receive stops, its buffers go back)."""
    timeout = self.limits.pair_wait_s
    deadline = time.monotonic() + timeout
    with self._cond:
      while True:
        transfer = self._open.get(transfer_id)
        if transfer is not None and not transfer.claimed:
          transfer.claimed = True
          transfer.connection = connection
          return transfer
        if transfer is not None:
          return "its transfer id is already being received"
        if transfer_id in self._ended:
          return "its call already ended (answered, refused or cancelled)"
        if self._closed:
          return "the listener is closing"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          return f"no call announced its transfer id within {timeout:g} s"
        self._cond.wait(remaining)


class _Late(TimeoutError):
  """A peer missed a BulkLimits bound; the message names it."""


def _recv_exact(sock: socket.socket, nbytes: int, deadline: float, what: str) -> bytes | None:
  """Exactly `nbytes` by `deadline` (monotonic), or None at a clean end of stream before the
  first byte."""
  data = bytearray()
  while len(data) < nbytes:
    remaining = deadline - time.monotonic()
    try:
      if remaining <= 0:
        raise TimeoutError
      sock.settimeout(remaining)
      piece = sock.recv(nbytes - len(data))
    except TimeoutError:
      raise _Late(f"{len(data)} of the {nbytes} bytes of {what} arrived in time") from None
    if not piece:
      if not data:
        return None
      raise ConnectionError(f"the connection closed {len(data)} bytes into {what}")
    data += piece
  return bytes(data)


def _receive_into(sock: socket.socket, buffers: Sequence[np.ndarray], stall_s: float
                  ) -> str | None:
  """Fills `buffers` from `sock`, each byte within `stall_s` of the last; returns why not (None:
  filled). Returns rather than raises, so no traceback keeps a buffer out of the pool."""
  total = sum(b.nbytes for b in buffers)
  received = 0
  sock.settimeout(stall_s)
  try:
    for buffer in buffers:
      view = memoryview(buffer).cast("B")
      filled = 0
      while filled < view.nbytes:
        n = sock.recv_into(view[filled:], min(RECV_BYTES, view.nbytes - filled))
        if not n:
          return (f"the bulk connection broke mid-transfer: the connection closed after "
                  f"{received} of {total} bytes")
        filled += n
        received += n
  except TimeoutError:
    return (f"the bulk frame stalled after {received} of its {total} bytes: none came for "
            f"{stall_s:g} s (BulkLimits.stall_s)")
  except OSError as e:
    return f"the bulk connection broke mid-transfer: {e}"
  return None


def _hung_up(sock: socket.socket) -> bool:
  """True once the peer closed its end (or the connection failed); never blocks or reads."""
  poller = select.poll()
  poller.register(sock, select.POLLRDHUP)
  return bool(poller.poll(0))


class BulkListener:
  """Receives frames on `host`: a thread per connection (so the event loop moves no bytes),
  each frame into buffers from `pool`, delivered to the call that announced it; `transfers`
  carries the limits it enforces."""

  def __init__(self, pool: buffers_lib.HostBufferPool, transfers: Transfers, *,
               host: str = "127.0.0.1") -> None:
    self._pool = pool
    self._transfers = transfers
    self.limits = transfers.limits
    self._host = host
    self._sock: socket.socket | None = None
    self._lock = threading.Lock()
    self._connections: set[socket.socket] = set()
    self._claiming: set[socket.socket] = set()  # their threads wait for a call, not for the peer
    self._threads: list[threading.Thread] = []
    self.port: int | None = None

  def start(self) -> int:
    sock = socket.socket(_family(self._host), socket.SOCK_STREAM)
    try:
      if sock.family == socket.AF_INET6:  # "::" takes IPv4 connections too, as tunix's "[::]"
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
      sock.bind((self._host, 0))
      sock.listen(self.limits.max_connections)
    except OSError:
      sock.close()
      raise
    self._sock, self.port = sock, sock.getsockname()[1]
    thread = threading.Thread(target=self._accept, args=(sock,), name="trainer-bulk-accept",
                              daemon=True)
    self._threads.append(thread)
    thread.start()
    return self.port

  def _accept(self, listening: socket.socket) -> None:
    while True:
      try:
        conn, peer = listening.accept()
      except OSError:  # closed: the listener is stopping
        return
      with self._lock:
        stopping = self._sock is None
        held = len(self._connections)
        if held >= self.limits.max_connections:
          # A connection whose peer closed it is on its way out (its thread, reading, sees the
          # end at once): it does not count, unless its thread waits for a call instead.
          held = sum(c in self._claiming or not _hung_up(c) for c in self._connections)
        if not stopping and held < self.limits.max_connections:
          self._connections.add(conn)
          self._threads = [t for t in self._threads if t.is_alive()]
          thread = threading.Thread(target=self._serve, args=(conn,), name="trainer-bulk-recv",
                                    daemon=True)
          self._threads.append(thread)
          thread.start()
          continue
      if not stopping:
        why = (f"{held} bulk connections are open, this trainer's cap "
               "(BulkLimits.max_connections); one client queues its sends within it, so the "
               "others are held by other clients")
        log.warning("refused a bulk connection from %s:%d: %s", peer[0], peer[1], why)
        _refuse(conn, why)
      conn.close()

  def _serve(self, conn: socket.socket) -> None:
    try:
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      conn.settimeout(self.limits.header_wait_s)
      conn.sendall(ACCEPTED)
      while self._receive_frame(conn):
        pass
    except _Late as e:
      log.info("closed a bulk connection: %s", e)
    except OSError as e:  # the peer went away or the listener is stopping
      log.debug("bulk connection ended: %s", e)
    finally:
      with self._lock:
        self._connections.discard(conn)
      conn.close()

  def _receive_frame(self, conn: socket.socket) -> bool:
    """One frame; False when the connection should end (closed, or a frame not wanted)."""
    wait = self.limits.header_wait_s
    what = f"a frame header, due within {wait:g} s of the connection's last frame or its " \
           "opening (BulkLimits.header_wait_s)"
    deadline = time.monotonic() + wait
    head = _recv_exact(conn, HEADER.size, deadline, what)
    if head is None:
      return False
    magic, transfer_id, count = HEADER.unpack(head)
    refused = (f"not a bulk frame header (magic {magic!r})" if magic != MAGIC else
               f"it announced {count} buffers; a frame carries at most {wire.MAX_BUFFERS}"
               if count > wire.MAX_BUFFERS else None)
    sizes: list[int] = []
    if refused is None and count:
      raw_sizes = _recv_exact(conn, 8 * count, deadline, what)
      if raw_sizes is None:
        raise ConnectionError("the connection closed inside a frame header")
      sizes = list(struct.unpack(f"<{count}Q", raw_sizes))
    with self._lock:
      self._claiming.add(conn)
    try:
      claimed = self._transfers.claim(transfer_id, conn)
    finally:
      with self._lock:
        self._claiming.discard(conn)
    if refused is not None:  # its call, if one announced its id, hears why
      log.warning("dropped a bulk connection: %s", refused)
      if not isinstance(claimed, str):
        _fail(claimed, wire.WireError(f"its bulk frame was refused: {refused}"))
      return False
    if isinstance(claimed, str):
      log.debug("dropped a bulk frame: %s", claimed)
      return False
    if sizes != claimed.sizes:
      _fail(claimed, wire.WireError(
          f"the bulk frame announced buffer sizes {sizes!r:.80} where the call's header "
          f"announced {claimed.sizes!r:.80}"))
      return False
    started = time.perf_counter()
    buffers = self._pool.take_all(sizes)
    failure = _receive_into(conn, buffers, self.limits.stall_s)
    if failure is not None:
      buffers.clear()  # back to the pool: nothing else holds them
      log.info("a bulk frame failed: %s", failure)
      _fail(claimed, wire.WireError(failure))
      return False
    try:
      claimed.future.set_result(Received(buffers, started, time.perf_counter()))
    except concurrent.futures.InvalidStateError:  # the call ended meanwhile: drop the bytes
      pass
    return True

  def close(self, timeout: float = 2.0) -> None:
    """Stops accepting, ends every connection and joins the threads (bounded)."""
    with self._lock:
      sock, self._sock = self._sock, None
      connections = list(self._connections)
      threads = list(self._threads)
    self._transfers.close()
    if sock is not None:
      try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in its thread (Linux)
      except OSError:
        pass
      sock.close()
    for conn in connections:
      try:
        conn.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
    deadline = time.monotonic() + timeout
    for thread in threads:
      thread.join(max(0.0, deadline - time.monotonic()))


def _shutdown(sock: socket.socket) -> None:
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass


def _family(host: str) -> socket.AddressFamily:
  return socket.AF_INET6 if ":" in host else socket.AF_INET


class Pacer(Protocol):
  """An emulated link the sender waits on before each chunk (the embedded host's LinkPacer)."""

  bytes_per_s: float | None  # None: not paced

  async def transmit(self, nbytes: int) -> None: ...


def _refuse(conn: socket.socket, why: str) -> None:
  """Tells a connection why it is refused, never blocking the accepting thread."""
  try:
    conn.setblocking(False)
    conn.send(REFUSED + why.encode()[:MAX_REFUSAL_BYTES - 1])
    conn.shutdown(socket.SHUT_WR)
  except OSError:
    pass


def _fail(transfer: _Transfer, error: BaseException) -> None:
  try:
    transfer.future.set_exception(error)
  except concurrent.futures.InvalidStateError:
    pass


class Lease:
  """One connection a sender holds for one frame, and its slot within the listener's cap.

  `sent` gives the connection back once its frame went out: idle for the next frame (its slot
  free at once) or closed. A closed one's slot stays taken until `end` (the call has its answer):
  until then the listener may still count the connection, its thread waiting for the call's
  header to claim the frame already sent."""

  __slots__ = ("sock", "_sender", "_connection_back", "_slot_back")

  def __init__(self, sender: "BulkSender", sock: socket.socket) -> None:
    self.sock = sock
    self._sender = sender
    self._connection_back = False
    self._slot_back = False

  def sent(self, whole: bool) -> None:
    """The frame went out (`whole`) or not (the connection then closes)."""
    if not self._connection_back:
      self._connection_back = True
      if self._sender._keep_idle(self.sock, whole):  # pylint: disable=protected-access
        self._free_slot()

  def end(self) -> None:
    """The call is over, whatever happened: its connection and slot are back."""
    self.sent(False)
    self._free_slot()

  def _free_slot(self) -> None:
    if not self._slot_back:
      self._slot_back = True
      self._sender._slots.release()  # pylint: disable=protected-access


class BulkSender:
  """The orchestrator's side: frames sent on connections it leases within the listener's
  `limits` (a call waits for one when all are in use), from the arrays' own memory, each chunk
  paced by the emulated link first (if any). A connection is reused only after a whole frame went
  out."""

  def __init__(self, host: str, port: int, pacer: Pacer | None = None,
               limits: BulkLimits = BulkLimits()) -> None:
    self._address = (host, port)
    self._pacer = pacer
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
    return Lease(self, sock)

  def _reusable(self) -> socket.socket | None:
    """The most recent idle connection still well inside the listener's header wait; older or
    closed ones are closed."""
    now, fresh = time.monotonic(), []
    for sock, since in self._idle:
      if now - since < self.limits.header_wait_s / 2 and not _hung_up(sock):
        fresh.append((sock, since))
      else:
        sock.close()
    self._idle = fresh
    return self._idle.pop()[0] if self._idle else None

  async def _connect(self) -> socket.socket:
    loop = asyncio.get_running_loop()
    sock = socket.socket(_family(self._address[0]), socket.SOCK_STREAM)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
      await loop.sock_connect(sock, self._address)
      answer = await loop.sock_recv(sock, MAX_REFUSAL_BYTES)
      if answer != ACCEPTED:
        while answer[:1] == REFUSED and len(answer) < MAX_REFUSAL_BYTES:
          more = await loop.sock_recv(sock, MAX_REFUSAL_BYTES - len(answer))
          if not more:
            break
          answer += more
        why = (answer[1:].decode(errors="replace") if answer[:1] == REFUSED else
               f"it answered {answer[:16]!r} where {ACCEPTED!r} accepts")
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
                 pace: float = 1.0) -> None:
    """Sends one frame on `lease`'s connection, then gives the connection back (`Lease.sent`)."""
    loop = asyncio.get_running_loop()
    sizes = [b.nbytes for b in buffers]
    header = HEADER.pack(MAGIC, transfer_id, len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes)
    chunk_bytes = wire.CHUNK_BYTES
    if self._pacer is not None and self._pacer.bytes_per_s is not None:
      chunk_bytes = max(1, min(chunk_bytes, int(self._pacer.bytes_per_s / pace * PACED_CHUNK_S)))
    whole = False
    try:
      await loop.sock_sendall(lease.sock, header)
      for chunk in wire.iter_chunks(buffers, chunk_bytes):
        if self._pacer is not None:
          await self._pacer.transmit(round(chunk.nbytes * pace))
        await loop.sock_sendall(lease.sock, chunk)
        self.sent_bytes += chunk.nbytes
      whole = True
    finally:
      lease.sent(whole)

  def close(self) -> None:
    idle, self._idle = self._idle, []
    for sock, _ in idle:
      sock.close()
