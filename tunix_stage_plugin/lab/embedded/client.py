"""The orchestrator's end of the embedded host: an async client for the trainer's method-call
service, with an emulated wire, and the pipeline's engine over it (`EmbeddedEngine`:
core.pipeline.StageEngine; the trainer's errors typed by core.contract.typed_errors, as on tunix's
host).

A call is encoded as tunix's host encodes it (transport/wire.py): one unary message when its
arrays total at most UNARY_MAX_BYTES, else the bulk format's header on gRPC and its parts' bytes
on the bulk channel (transport/); the trainer's failure comes back as contract.RemoteError
(docs/embedded.md "How a call travels").

Concurrent calls share one HTTP/2 connection and one emulated link (`LinkPacer`): a stage's bytes
and an inline train's bytes on the bulk channel (transport/) queue for the same bandwidth, as on a
real NIC. Only payload bytes are paced (the bulk bytes); headers and small unary calls are not.
A bulk call holds a connection for its bytes before its header goes out: the client's one
`BulkSender` sends on at most the trainer's cap of connections (wire.BulkLimits, announced by
BulkPort), further calls wait for one, and a connection the trainer refuses (other clients hold
the cap) fails the call at once with the trainer's reason (docs/embedded.md "Limits of the bulk
channel").

Liveness (docs/embedded.md "Liveness bound"): a watchdog per client asks the trainer for a heartbeat
(answered at once, off every lane) whenever calls are in flight and nothing has been heard from it
for a quarter of the liveness bound; a heartbeat unanswered within another quarter fails every call
in flight at once (their bulk sends included), so a trainer that stops answering (SIGSTOP, a hung
host) is reported within about half the bound, however long the calls were expected to take. Calls
made after that get a short deadline of their own (DEAD_PEER_DEADLINE_S: the cleanup after a dead
peer, e.g. a reset), until the trainer is heard from again. Each call also keeps a deadline of what
it is expected to take (its bytes over the link's bandwidth, a weight sync's announced seconds) plus
the bound, for a trainer that answers heartbeats but never answers the call. Either way the caller
gets one TrainerUnresponsiveError naming the trainer and the call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import re
import time
from typing import Any, Callable

import grpc

from tunix_stage_plugin.core import contract
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.lab.bench import trace as trace_lib
from tunix_stage_plugin.lab.embedded import pacing
from tunix_stage_plugin.lab.embedded import server as server_lib
from tunix_stage_plugin.transport import wire
from tunix_stage_plugin.transport import sender as sender_lib

_ADDRESS_RE = re.compile(r"(?P<host>[A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(?P<port>[0-9]{1,5})")


DEFAULT_LIVENESS_S = 60.0
# A call whose arrays total at most this goes whole as one unary message; a larger one in bulk.
UNARY_MAX_BYTES = 1 << 20
# What any call may take before its reply, on top of its bytes: scheduling, (un)pickling, a lane.
CALL_BASE_S = 2.0
# The bandwidth assumed for an unpaced link: loopback gRPC runs at ~1 GB/s, a loaded machine less.
UNPACED_BYTES_PER_S = 100e6
# Calls whose first argument announces how long the trainer will hold them, in seconds.
ANNOUNCED_SECONDS = frozenset({"weight_sync"})
# How grpc words a connection the keepalive pings found silent (it sets TCP_USER_TIMEOUT to the
# keepalive timeout, so the socket itself times out).
_TIMEOUT_WORDS = ("timed out", "keepalive", "ping timeout")
# Once the trainer was found unresponsive, calls get at most this deadline until it is heard from
# again: a reset answers in milliseconds on a live trainer, and cleanup after a dead peer must not
# spend another bound.
DEAD_PEER_DEADLINE_S = 1.0
# The shortest wait for a watchdog heartbeat (a quarter bound, but not less on a loaded machine).
MIN_PROBE_S = 0.5
# A bulk send that failed leaves the call this long to bring its own answer (e.g. a refusal by its
# header, after which the trainer drops the bytes' connection) before the send's error is reported.
SEND_FAILURE_GRACE_S = 1.0


def _bulk(encoded: wire.EncodedRequest) -> bool:
  return encoded.out_of_band_bytes > UNARY_MAX_BYTES


class TrainerUnresponsiveError(ConnectionError):
  """The trainer stopped answering: a call got no reply and a heartbeat none either (the
  watchdog), or a call got none within its expected time + the bound (its deadline)."""


class TrainerGoneError(ConnectionError):
  """The connection to the trainer broke and it refuses new ones: it exited or was killed."""


def _timed_out(e: grpc.aio.AioRpcError) -> bool:
  details = (e.details() or "").lower()
  return any(word in details for word in _TIMEOUT_WORDS)


def _unanswered(e: grpc.aio.AioRpcError) -> bool:
  """The call got no answer in time (its deadline, or the connection's keepalive)."""
  return e.code() is grpc.StatusCode.DEADLINE_EXCEEDED or _timed_out(e)


_HEARTBEAT = wire.encode_whole(None, "heartbeat", (), {})  # one small message, made once


# What a call to the trainer can fail with; a command reports each in one line and exits 1.
CALL_ERRORS = (ConnectionError, contract.RemoteError, wire.WireError, grpc.aio.AioRpcError)


def describe_call_error(e: BaseException, trainer: str) -> str:
  """One line for a CALL_ERRORS exception; gRPC's own errors get their status code, the
  trainer's own its type and first line."""
  if isinstance(e, grpc.aio.AioRpcError):
    return f"a call to {trainer} failed: {e.code().name}: {e.details()}"
  if isinstance(e, contract.RemoteError):
    return f"a call to {trainer} failed there: {e.type_name}: {e.message}"
  return str(e)


def decode_reply(message: bytes) -> Any:
  """A reply's result, or the trainer's error raised as contract.RemoteError."""
  return contract.unwrap(pickle.loads(message))


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


class _Flight:
  """A call in flight: what the watchdog needs to fail it."""

  __slots__ = ("method", "started", "verdict")

  def __init__(self, method: str, verdict: asyncio.Future) -> None:
    self.method = method
    self.started = time.monotonic()
    self.verdict = verdict  # set to an exception by the watchdog: the call fails with it


class WorkerClient:
  """Calls the trainer's methods; `async with` closes the channel.

  `liveness_s` (orchestrator_main --liveness_s): a trainer that answers nothing, heartbeats
  included, is reported within half of it (the watchdog); a call may also go this long past its
  expected time without a reply before it fails. Keep it well above the longest a healthy trainer
  holds a call beyond its bytes: a stage waits up to 30 s for a device slot, a train by key up to
  60 s for its stage to land.
  """

  def __init__(self, address: str, *, wire_bytes_per_s: float | None = None,
               liveness_s: float = DEFAULT_LIVENESS_S) -> None:
    self.address = check_address(address)
    self._host = _ADDRESS_RE.fullmatch(address)["host"].strip("[]")
    self.pacer = pacing.LinkPacer(wire_bytes_per_s)
    self.liveness_s = check_liveness(liveness_s)
    self._channel = grpc.aio.insecure_channel(
        address, options=[*server_lib.grpc_options(), *keepalive_options(self.liveness_s)])
    self._unary = self._channel.unary_unary(server_lib.CALL)
    self._bulk_header = self._channel.unary_unary(server_lib.CALL_BULK)
    self._bulk_port = self._channel.unary_unary(server_lib.BULK_PORT)
    self._sender: sender_lib.BulkSender | None = None
    self._sender_made = asyncio.Lock()  # concurrent first bulk calls make one sender
    # The watchdog (docs/embedded.md "Liveness bound"): quiet for silence_s with calls in flight
    # -> a heartbeat with probe_s to answer; none -> every call in flight fails.
    self.silence_s = self.liveness_s / 4
    self.probe_s = max(MIN_PROBE_S, self.liveness_s / 4)
    self._flights: set[_Flight] = set()
    self._heard = time.monotonic()  # the last reply of any kind from the trainer
    self._watchdog: asyncio.Task | None = None
    self.unresponsive: TrainerUnresponsiveError | None = None  # until heard from again

  async def __aenter__(self) -> "WorkerClient":
    return self

  async def __aexit__(self, *exc: Any) -> None:
    await self.close()

  @property
  def bulk_sent_bytes(self) -> int:
    """Array bytes this client handed to the bulk channel's sockets so far."""
    return 0 if self._sender is None else self._sender.sent_bytes

  async def close(self) -> None:
    if self._watchdog is not None:
      self._watchdog.cancel()
      await asyncio.gather(self._watchdog, return_exceptions=True)
      self._watchdog = None
    if self._sender is not None:
      self._sender.close()
    await self._channel.close()

  async def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
    """Waits until the trainer answers a heartbeat; raises ConnectionError naming the address."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
      try:
        return decode_reply(await self._unary(_HEARTBEAT, timeout=min(5.0, timeout_s)))
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

  def expected_s(self, encoded: wire.EncodedRequest, args: tuple[Any, ...] = ()) -> float:
    """What a call is expected to take: its bytes over the link (behind the bytes queued on it),
    plus the seconds a weight sync announces, plus CALL_BASE_S."""
    expected = CALL_BASE_S
    if _bulk(encoded):
      rate = self.pacer.bytes_per_s
      backlog = 0.0 if rate is None else self.pacer.backlog_s()
      expected += backlog + encoded.out_of_band_bytes / (rate or UNPACED_BYTES_PER_S)
    if encoded.method in ANNOUNCED_SECONDS and args and isinstance(args[0], (int, float)):
      expected += max(0.0, float(args[0]))
    return expected

  async def call(self, method: str, *args: Any, _timeout_s: float | None = None,
                 _pace: float = 1.0, _carried: dict[str, Any] | None = None,
                 **kwargs: Any) -> Any:
    """Runs `method(*args, **kwargs)` on the trainer; returns its result or raises its error.

    `_timeout_s` replaces the derived deadline (expected time + the liveness bound). `_pace`
    makes this call's payload cross the emulated link that many times slower (the benchmark's
    bursty scenario). `_carried["transport"]` is set to the transport that carries the call
    (contract.SIDE_CHANNEL: the bulk channel; contract.UNARY: one gRPC message). Raises
    TrainerUnresponsiveError when the trainer stops answering.
    """
    if not 1.0 <= _pace < float("inf"):
      raise ValueError(f"_pace must be a finite slowdown >= 1; got {_pace!r}")
    encoded = wire.encode(None, method, args, kwargs)
    if _carried is not None:
      _carried["transport"] = contract.SIDE_CHANNEL if _bulk(encoded) else contract.UNARY
    expected = self.expected_s(encoded, args) * _pace
    timeout = _timeout_s if _timeout_s is not None else expected + self.liveness_s
    after_dead_peer = self.unresponsive is not None
    if after_dead_peer:
      timeout = min(timeout, DEAD_PEER_DEADLINE_S)
    start = time.monotonic()
    flight = _Flight(method, asyncio.get_running_loop().create_future())
    work = asyncio.ensure_future(self._send(encoded, args, kwargs, timeout, _pace))
    self._flights.add(flight)
    self._watch()
    try:
      try:
        await asyncio.wait({work, flight.verdict}, return_when=asyncio.FIRST_COMPLETED)
      finally:
        if not work.done():  # the watchdog's verdict (or this task's cancellation)
          work.cancel()
          await asyncio.gather(work, return_exceptions=True)
      if work.cancelled():
        if not flight.verdict.done() or flight.verdict.cancelled():
          raise asyncio.CancelledError  # cancelled from inside grpc, not by the watchdog
        verdict = flight.verdict.exception()
      else:
        verdict = None
        reply = work.result()
    except grpc.aio.AioRpcError as e:
      if after_dead_peer and e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        raise self._unresponsive(method, f"got no reply within {timeout:g} s, the deadline of a "
                                 "call made after the trainer was found unresponsive") from e
      raise await self._diagnose(e, method, time.monotonic() - start, timeout, expected) from e
    except OSError as e:  # the bulk connection failed (refused, reset) and the call did not answer
      raise await self._diagnose_bulk(e, method, time.monotonic() - start) from e
    finally:
      self._flights.discard(flight)
      if not flight.verdict.done():
        flight.verdict.cancel()
      elif not flight.verdict.cancelled():
        flight.verdict.exception()  # retrieved (the call may have had its answer meanwhile)
    if verdict is not None:
      raise verdict  # the trainer stopped answering: a heartbeat got no reply either
    self._heard_from()
    return decode_reply(reply)

  async def _send(self, encoded: wire.EncodedRequest, args: tuple[Any, ...],
                  kwargs: dict[str, Any], timeout: float, pace: float) -> bytes:
    if not _bulk(encoded):
      # Small messages are not paced: a train-by-key call never queues behind a stage's
      # payload on the emulated link.
      whole = wire.encode_whole(None, encoded.method, args, kwargs)
      return await self._unary(whole, timeout=timeout)
    return await self._call_bulk(encoded, timeout, pace)

  def _heard_from(self) -> None:
    self._heard = time.monotonic()
    self.unresponsive = None

  def _watch(self) -> None:
    if self._watchdog is None or self._watchdog.done():
      self._watchdog = asyncio.ensure_future(self._watch_calls())

  async def _watch_calls(self) -> None:
    """While calls are in flight: quiet for silence_s -> a heartbeat; none within probe_s ->
    every call in flight fails with TrainerUnresponsiveError."""
    while self._flights:
      quiet_since = max(self._heard, min(f.started for f in self._flights))
      wait = quiet_since + self.silence_s - time.monotonic()
      if wait > 0:
        await asyncio.sleep(wait)  # a timer: the watchdog's period, nothing waits on it
        continue
      try:
        await self._unary(_HEARTBEAT, timeout=self.probe_s)
      except grpc.aio.AioRpcError as e:
        if _unanswered(e):
          self._fail_flights()
        else:  # refused or reset: the calls fail on their own (the trainer went away)
          await asyncio.sleep(self.probe_s)
        continue
      self._heard_from()

  def _fail_flights(self) -> None:
    now = time.monotonic()
    for flight in list(self._flights):
      error = self._unresponsive(flight.method, f"got no reply within {now - flight.started:.1f} s "
                                 f"and a heartbeat then got none within {self.probe_s:g} s")
      if not flight.verdict.done():
        flight.verdict.set_exception(error)
      self.unresponsive = error
    self._flights.clear()

  async def _bulk_sender(self, timeout: float) -> sender_lib.BulkSender:
    """The client's one sender, made by its first bulk call (the others wait for it)."""
    async with self._sender_made:
      if self._sender is None:
        port, limits = wire.read_announcement(await self._bulk_port(b"", timeout=timeout))
        self._sender = sender_lib.BulkSender(self._host, port, limits)
    return self._sender

  async def _call_bulk(self, encoded: wire.EncodedRequest, timeout: float,
                       pace: float) -> bytes:
    """The header on gRPC and the bytes on the bulk channel, at once, once a connection for the
    bytes is held (within the trainer's cap: this client's sends queue for one, each ending
    within the bulk channel's bounds); the call's answer wins."""
    transfer = wire.new_transfer_id()
    return await sender_lib.call_with_bytes(
        self._bulk_header(encoded.header(transfer), timeout=timeout),
        await self._bulk_sender(timeout), transfer, encoded.parts, SEND_FAILURE_GRACE_S,
        None if self.pacer.bytes_per_s is None else self.pacer.chunks(pace))

  async def _diagnose(self, e: grpc.aio.AioRpcError, method: str, waited: float, timeout: float,
                      expected: float) -> BaseException:
    """One line for a trainer that stopped answering or went away; other errors pass unchanged.

    A connection that broke without saying why (a call fails as INTERNAL or UNAVAILABLE) is told
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
    return await self._probe(method, waited, f"{e.code().name}: {e.details()}") or e

  async def _diagnose_bulk(self, e: OSError, method: str, waited: float) -> BaseException:
    """A broken bulk connection: the trainer went away, stopped answering, or only the
    connection failed (a WireError naming it)."""
    return await self._probe(method, waited, f"its bytes' connection: {e}") or wire.WireError(
        f"{method}: the connection carrying its bytes to {self.address} failed: "
        f"{type(e).__name__}: {e}")

  async def _probe(self, method: str, waited: float, failure: str) -> BaseException | None:
    """After `method` failed (`failure`): a heartbeat within what is left of the bound tells
    a trainer that stopped answering or went away (the error to raise) from one that answers
    (None: the call's own failure)."""
    try:
      await self._unary(_HEARTBEAT, timeout=max(1.0, self.liveness_s - waited))
    except grpc.aio.AioRpcError as probe:
      if _unanswered(probe):
        return self._unresponsive(method, f"failed after {waited:.0f} s ({failure}) and a "
                                  "heartbeat then got no reply")
      return TrainerGoneError(f"trainer at {self.address} went away during {method} "
                              f"({failure}); a heartbeat then failed too ({probe.code().name})")
    return None

  def _unresponsive(self, method: str, why: str) -> TrainerUnresponsiveError:
    return TrainerUnresponsiveError(
        f"trainer at {self.address} stopped answering: {method} {why} (liveness bound "
        f"{self.liveness_s:g} s, --liveness_s)")

  async def clock_offset(self, samples: int = 7) -> tuple[float, float]:
    """(offset, uncertainty): trainer perf_counter + offset = this process's (timeline)."""

    async def remote_clock() -> float:
      return (await self.call("heartbeat"))["time"]

    return await trace_lib.clock_offset(remote_clock, samples)


# ---------------------------------------------------------------- the pipeline's engine


@dataclasses.dataclass
class WireStats:
  """Bytes of the micro-batches sent, as arrays (raw) and as they crossed the wire (sent)."""

  stages: int = 0
  stage_raw_bytes: int = 0
  stage_sent_bytes: int = 0
  inline: int = 0
  inline_bytes: int = 0
  encode_s: float = 0.0  # orchestrator seconds packing stage payloads (off the event loop)

  @property
  def ratio(self) -> float | None:
    return self.stage_raw_bytes / self.stage_sent_bytes if self.stage_sent_bytes else None

  def as_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "ratio": self.ratio}


class EmbeddedEngine:
  """stage / train / reset for core.pipeline.StagePipeline, plus the step boundary's calls.

  `codec` (core.codec.Codec, TUNIX_STAGE_CODEC): a stage's payload is packed on a worker thread
  (never on the event loop) and the trainer unpacks it on its staging lane; train calls that
  carry their micro-batch (inline) always send it as it is.
  """

  def __init__(self, client: WorkerClient, *,
               transfer_slowdown: Callable[[data_lib.Batch], float] | None = None,
               codec: Any = None) -> None:
    self.client = client
    # The benchmark's bursty scenario: a micro-batch's payload crosses the emulated wire this
    # many times slower, whichever call carries it.
    self._slowdown = transfer_slowdown or (lambda batch: 1.0)
    self.codec = codec
    self.wire = WireStats()
    self.recorder: recorder_lib.Recorder = recorder_lib.DISABLED  # each payload's send (telemetry)
    self.auto: Any = None  # core.sizing.AutoDepth, told each stage's answer (a job at auto)

  async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
    """One call to the trainer; its error, when the plugin has a type for it, raised as that."""
    with contract.typed_errors(method):  # the one map of the trainer's errors (contract.py)
      return await self.client.call(method, *args, **kwargs)

  async def _send(self, method: str, nbytes: int, *args: Any, **kwargs: Any) -> Any:
    """One call carrying a micro-batch, its send recorded by the transport that carried it (the
    bulk channel, or one gRPC message for a small one)."""
    call = recorder_lib.CALL.get()
    with self.recorder.span(tracks.ORCHESTRATOR_SEND, method, transport=contract.UNARY,
                            bytes=nbytes, step=None if call is None else call[0]) as sent:
      return await self._call(method, *args, _carried=sent, **kwargs)

  def _pack(self, payload: data_lib.Batch) -> data_lib.PackedBatch:
    """Runs on a worker thread."""
    return data_lib.pack_batch(self.codec, payload)

  async def stage(self, payload: data_lib.Batch, *, key: str) -> contract.StageOutcome:
    sent: Any = payload
    sent_bytes = payload.nbytes
    if self.codec is not None:
      start = asyncio.get_running_loop().time()
      sent = await asyncio.to_thread(self._pack, payload)
      self.wire.encode_s += asyncio.get_running_loop().time() - start
      sent_bytes = sent.wire_bytes
    self.wire.stages += 1
    self.wire.stage_raw_bytes += payload.nbytes
    self.wire.stage_sent_bytes += sent_bytes
    answer = contract.StageOutcome.from_dict(await self._send(
        "stage_batch", sent_bytes, sent, key=key, _pace=self._slowdown(payload)))
    if self.auto is not None:  # the trainer's newest step on it, for the depth at auto
      self.auto.answered(answer)
    return answer

  async def train(self, payload: data_lib.Batch | None, *, stage_key: str | None,
                  apply_optimizer: bool) -> contract.Trained:
    if stage_key is not None:
      result = await self._call("fwd_bwd", stage_key=stage_key)
    else:
      result = await self._train_inline(payload)
    return contract.Trained(await self._maybe_update(result, apply_optimizer),
                               fallback=result["placement_fallback"])

  async def _train_inline(self, payload: data_lib.Batch) -> dict[str, Any]:
    self.wire.inline += 1
    self.wire.inline_bytes += payload.nbytes
    return await self._send("fwd_bwd", payload.nbytes, payload, _pace=self._slowdown(payload))

  async def train_resident(self, mb_id: str, *, apply_optimizer: bool) -> contract.Trained:
    result = await self._call("fwd_bwd", resident=mb_id)
    return contract.Trained(await self._maybe_update(result, apply_optimizer))

  def resident(self) -> "ResidentEngine":
    return ResidentEngine(self)

  async def _maybe_update(self, result: dict[str, Any], apply_optimizer: bool) -> dict[str, Any]:
    if apply_optimizer:
      result = {**result, **await self._call("update")}
    return result

  async def reset(self, keys: list[str]) -> None:
    await self._call("reset_staged", keys)

  async def weight_sync(self, seconds: float) -> None:
    await self._call("weight_sync", seconds)


class ResidentEngine:
  """Trains micro-batches already resident on the trainer (the benchmark's ceiling); never stages."""

  def __init__(self, engine: EmbeddedEngine) -> None:
    self._engine = engine

  async def stage(self, payload: data_lib.Batch, *, key: str) -> contract.StageOutcome:
    raise NotImplementedError("resident micro-batches are never staged")

  async def train(self, payload: data_lib.Batch, *, stage_key: str | None,
                  apply_optimizer: bool) -> contract.Trained:
    return await self._engine.train_resident(payload.mb_id, apply_optimizer=apply_optimizer)

  async def reset(self, keys: list[str]) -> None:
    raise NotImplementedError("resident micro-batches are never staged")
