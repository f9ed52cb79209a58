"""Async client for the trainer's generic method-call service, with an emulated wire.

Concurrent calls share one HTTP/2 connection and one emulated link (`LinkPacer`): a stage stream
and an inline train stream queue for the same bandwidth, as on a real NIC. Only payload bytes are
paced (the streamed bytes); headers and small unary calls are not.

Liveness (README "Liveness bound"): the channel pings the trainer (HTTP/2 keepalive) so a trainer
that stops answering (SIGSTOP, a hung host) fails every call in flight within the liveness bound,
however long the call was expected to take; each call also gets a deadline of what it is expected
to take (its bytes over the link's bandwidth, a weight sync's announced seconds) plus that bound.
Either way the caller gets one TrainerUnresponsiveError naming the trainer and the call.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import grpc

from tunix_stage_plugin.embedded import bulk as bulk_lib
from tunix_stage_plugin.embedded import pacing
from tunix_stage_plugin.embedded import wire

_ADDRESS_RE = re.compile(r"(?P<host>[A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(?P<port>[0-9]{1,5})")


DEFAULT_LIVENESS_S = 60.0
# What any call may take before its reply, on top of its bytes: scheduling, (un)pickling, a lane.
CALL_BASE_S = 2.0
# The bandwidth assumed for an unpaced link: loopback gRPC runs at ~1 GB/s, a loaded machine less.
UNPACED_BYTES_PER_S = 100e6
# Calls whose first argument announces how long the trainer will hold them, in seconds.
ANNOUNCED_SECONDS = frozenset({"weight_sync"})
# How grpc words a connection the keepalive pings found silent (it sets TCP_USER_TIMEOUT to the
# keepalive timeout, so the socket itself times out).
_TIMEOUT_WORDS = ("timed out", "keepalive", "ping timeout")
# A bulk send that failed leaves the call this long to bring its own answer (e.g. a refusal by its
# header, after which the trainer drops the bytes' connection) before the send's error is reported.
SEND_FAILURE_GRACE_S = 1.0


class TrainerUnresponsiveError(ConnectionError):
  """The trainer stopped answering: a call got no reply within its expected time + the bound."""


class TrainerGoneError(ConnectionError):
  """The connection to the trainer broke and it refuses new ones: it exited or was killed."""


def _timed_out(e: grpc.aio.AioRpcError) -> bool:
  details = (e.details() or "").lower()
  return any(word in details for word in _TIMEOUT_WORDS)


# What a call to the trainer can fail with; a command reports each in one line and exits 1.
CALL_ERRORS = (ConnectionError, wire.RemoteCallError, wire.WireError, grpc.aio.AioRpcError)


def describe_call_error(e: BaseException, trainer: str) -> str:
  """One line for a CALL_ERRORS exception; gRPC's own errors get their status code."""
  if isinstance(e, grpc.aio.AioRpcError):
    return f"a call to {trainer} failed: {e.code().name}: {e.details()}"
  return str(e)


def check_address(address: str) -> str:
  match = _ADDRESS_RE.fullmatch(address or "")
  if not match or not 1 <= int(match["port"]) <= 65535:
    raise ValueError(f"trainer address must be HOST:PORT with PORT in 1..65535 "
                     f"(e.g. 127.0.0.1:50051); got {address!r}")
  return address


def keepalive_options(liveness_s: float) -> list[tuple[str, int]]:
  """A ping every quarter bound (>= 1 s), answered within another quarter: a silent trainer
  fails the connection after at most half the bound, calls in flight or not."""
  quarter_ms = max(1000, int(liveness_s * 250))
  return [
      ("grpc.keepalive_time_ms", quarter_ms),
      ("grpc.keepalive_timeout_ms", quarter_ms),
      ("grpc.keepalive_permit_without_calls", 1),
      ("grpc.http2.max_pings_without_data", 0),
  ]


def check_liveness(liveness_s: float) -> float:
  if not (isinstance(liveness_s, (int, float)) and 1.0 <= liveness_s < float("inf")):
    raise ValueError(f"liveness bound (--liveness_s): accepted a number of seconds >= 1; "
                     f"got {liveness_s!r}")
  return float(liveness_s)


class WorkerClient:
  """Calls the trainer's methods; `async with` closes the channel.

  `liveness_s`: how long past its expected time a call may go without a reply before the trainer
  is reported as stopped answering (orchestrator_main --liveness_s). Keep it well above the
  longest a healthy trainer holds a call beyond its bytes: a stage waits up to 30 s for a device
  slot, a train by key up to 60 s for its stage to land.
  """

  def __init__(self, address: str, *, wire_bytes_per_s: float | None = None,
               liveness_s: float = DEFAULT_LIVENESS_S) -> None:
    self.address = check_address(address)
    self._host = _ADDRESS_RE.fullmatch(address)["host"].strip("[]")
    self.pacer = pacing.LinkPacer(wire_bytes_per_s)
    self.liveness_s = check_liveness(liveness_s)
    self._channel = grpc.aio.insecure_channel(
        address, options=[*wire.grpc_options(), *keepalive_options(self.liveness_s)])
    self._unary = self._channel.unary_unary(wire.CALL)
    self._bulk_header = self._channel.unary_unary(wire.CALL_BULK)
    self._bulk_port = self._channel.unary_unary(wire.BULK_PORT)
    self._sender: bulk_lib.BulkSender | None = None

  async def __aenter__(self) -> "WorkerClient":
    return self

  async def __aexit__(self, *exc: Any) -> None:
    await self.close()

  @property
  def bulk_sent_bytes(self) -> int:
    """Array bytes this client handed to the bulk channel's sockets so far."""
    return 0 if self._sender is None else self._sender.sent_bytes

  async def close(self) -> None:
    if self._sender is not None:
      self._sender.close()
    await self._channel.close()

  async def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
    """Waits until the trainer answers a heartbeat; raises ConnectionError naming the address."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
      try:
        return wire.decode_reply("heartbeat", await self._unary(
            wire.encode_call("heartbeat", (), {}).unary, timeout=min(5.0, timeout_s)))
      except grpc.aio.AioRpcError as e:
        last = e
        try:
          await asyncio.wait_for(self._channel.channel_ready(),
                                 max(0.1, deadline - time.monotonic()))
        except asyncio.TimeoutError:
          break
    detail = last.details() if isinstance(last, grpc.aio.AioRpcError) else "no answer"
    raise ConnectionError(f"trainer at {self.address} did not answer within {timeout_s:.0f} s: "
                          f"{detail}")

  def expected_s(self, encoded: wire.EncodedCall, args: tuple[Any, ...] = ()) -> float:
    """What a call is expected to take: its bytes over the link (behind the bytes queued on it),
    plus the seconds a weight sync announces, plus CALL_BASE_S."""
    expected = CALL_BASE_S
    if encoded.unary is None:
      rate = self.pacer.bytes_per_s or UNPACED_BYTES_PER_S
      expected += self.pacer.backlog_s() + encoded.payload_bytes / rate
    if encoded.method in ANNOUNCED_SECONDS and args and isinstance(args[0], (int, float)):
      expected += max(0.0, float(args[0]))
    return expected

  async def call(self, method: str, *args: Any, _timeout_s: float | None = None,
                 _pace: float = 1.0, **kwargs: Any) -> Any:
    """Runs `method(*args, **kwargs)` on the trainer; returns its result or raises its error.

    `_timeout_s` replaces the derived deadline (expected time + the liveness bound). `_pace`
    makes this call's payload cross the emulated link that many times slower (the benchmark's
    bursty scenario). Raises TrainerUnresponsiveError when the trainer stops answering.
    """
    if not 1.0 <= _pace < float("inf"):
      raise ValueError(f"_pace must be a finite slowdown >= 1; got {_pace!r}")
    encoded = wire.encode_call(method, args, kwargs)
    expected = self.expected_s(encoded, args) * _pace
    timeout = _timeout_s if _timeout_s is not None else expected + self.liveness_s
    start = time.monotonic()
    try:
      if encoded.unary is not None:
        # Small messages are not paced: HTTP/2 interleaves them with a stream's frames, so a
        # train-by-key call never queues behind a stage's payload.
        reply = await self._unary(encoded.unary, timeout=timeout)
      else:
        reply = await self._call_bulk(encoded, timeout, _pace)
    except grpc.aio.AioRpcError as e:
      raise await self._diagnose(e, method, time.monotonic() - start, timeout, expected) from e
    except OSError as e:  # the bulk connection failed (refused, reset) and the call did not answer
      raise await self._diagnose_bulk(e, method, time.monotonic() - start) from e
    return wire.decode_reply(method, reply)

  async def _call_bulk(self, encoded: wire.EncodedCall, timeout: float, pace: float) -> bytes:
    """The header on gRPC and the bytes on the bulk channel, at once; the call's answer wins."""
    if self._sender is None:
      port = int(await self._bulk_port(b"", timeout=timeout))
      self._sender = bulk_lib.BulkSender(self._host, port, self.pacer)
    rpc = asyncio.ensure_future(self._bulk_header(encoded.header, timeout=timeout))
    send = asyncio.ensure_future(self._sender.send(encoded.transfer, encoded.buffers, pace))
    try:
      await asyncio.wait({rpc, send}, return_when=asyncio.FIRST_COMPLETED)
      if not rpc.done() and send.exception() is not None:
        await asyncio.wait({rpc}, timeout=SEND_FAILURE_GRACE_S)
        if not rpc.done():
          raise send.exception()
      return await rpc
    finally:
      for task in (rpc, send):
        task.cancel()
      await asyncio.gather(rpc, send, return_exceptions=True)

  async def _diagnose(self, e: grpc.aio.AioRpcError, method: str, waited: float, timeout: float,
                      expected: float) -> BaseException:
    """One line for a trainer that stopped answering or went away; other errors pass unchanged.

    A connection that broke without saying why (a stream's send fails as INTERNAL) is told
    apart by a heartbeat within what is left of the bound: no answer means stopped answering,
    a refused connection means the trainer went away, an answer means the call's own failure.
    """
    if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
      return self._unresponsive(method, f"got no reply within {timeout:.0f} s (expected "
                                f"{expected:.1f} s + the liveness bound {self.liveness_s:g} s)")
    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
      return e
    if _timed_out(e):
      return self._unresponsive(method, f"got no reply within {waited:.0f} s and the "
                                f"connection's keepalive pings went unanswered")
    try:
      await self._unary(wire.encode_call("heartbeat", (), {}).unary,
                        timeout=max(1.0, self.liveness_s - waited))
    except grpc.aio.AioRpcError as probe:
      if probe.code() is grpc.StatusCode.DEADLINE_EXCEEDED or _timed_out(probe):
        return self._unresponsive(method, f"failed after {waited:.0f} s ({e.code().name}: "
                                  f"{e.details()}) and a heartbeat then got no reply")
      return TrainerGoneError(f"trainer at {self.address} went away during {method} "
                              f"({e.code().name}: {e.details()}); a heartbeat then failed too "
                              f"({probe.code().name})")
    return e

  async def _diagnose_bulk(self, e: OSError, method: str, waited: float) -> BaseException:
    """A broken bulk connection: the trainer went away, stopped answering, or only the
    connection failed (a WireError naming it)."""
    try:
      await self._unary(wire.encode_call("heartbeat", (), {}).unary,
                        timeout=max(1.0, self.liveness_s - waited))
    except grpc.aio.AioRpcError as probe:
      if probe.code() is grpc.StatusCode.DEADLINE_EXCEEDED or _timed_out(probe):
        return self._unresponsive(method, f"failed after {waited:.0f} s (its bytes' connection: "
                                  f"{e}) and a heartbeat then got no reply")
      return TrainerGoneError(f"trainer at {self.address} went away during {method} (its bytes' "
                              f"connection: {e}); a heartbeat then failed too "
                              f"({probe.code().name})")
    return wire.WireError(f"{method}: the connection carrying its bytes to {self.address} "
                          f"failed: {type(e).__name__}: {e}")

  def _unresponsive(self, method: str, why: str) -> TrainerUnresponsiveError:
    return TrainerUnresponsiveError(
        f"trainer at {self.address} stopped answering: {method} {why} (liveness bound "
        f"{self.liveness_s:g} s, --liveness_s)")

  async def clock_offset(self, samples: int = 7) -> tuple[float, float]:
    """(offset, uncertainty): trainer perf_counter + offset = this process's perf_counter.

    Takes the sample with the shortest round trip; its error is at most half that round trip.
    """
    best: tuple[float, float] | None = None
    for _ in range(samples):
      t0 = time.perf_counter()
      remote = (await self.call("heartbeat"))["time"]
      t1 = time.perf_counter()
      if best is None or t1 - t0 < 2 * best[1]:
        best = ((t0 + t1) / 2 - remote, (t1 - t0) / 2)
    return best
