"""Async client for the trainer's generic method-call service, with an emulated wire.

Concurrent calls share one HTTP/2 connection and one emulated link (`LinkPacer`): a stage stream
and an inline train stream queue for the same bandwidth, as on a real NIC. Only payload bytes are
paced (the streamed bytes); headers and small unary calls are not.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any, AsyncIterator

import grpc

from tunix_stage_plugin.embedded import pacing
from tunix_stage_plugin.embedded import wire

_ADDRESS_RE = re.compile(r"(?P<host>[A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(?P<port>[0-9]{1,5})")


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


class WorkerClient:
  """Calls the trainer's methods; `async with` closes the channel."""

  def __init__(self, address: str, *, wire_bytes_per_s: float | None = None,
               timeout_s: float = 600.0) -> None:
    self.address = check_address(address)
    self.pacer = pacing.LinkPacer(wire_bytes_per_s)
    self.timeout_s = timeout_s
    self._channel = grpc.aio.insecure_channel(address, options=wire.grpc_options())
    self._unary = self._channel.unary_unary(wire.CALL)
    self._stream = self._channel.stream_unary(wire.CALL_STREAM)

  async def __aenter__(self) -> "WorkerClient":
    return self

  async def __aexit__(self, *exc: Any) -> None:
    await self.close()

  async def close(self) -> None:
    await self._channel.close()

  async def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
    """Waits until the trainer answers a heartbeat; raises ConnectionError naming the address."""
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
      try:
        return await self.call("heartbeat", _timeout_s=min(5.0, timeout_s))
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

  async def call(self, method: str, *args: Any, _timeout_s: float | None = None,
                 **kwargs: Any) -> Any:
    """Runs `method(*args, **kwargs)` on the trainer; returns its result or raises its error."""
    encoded = wire.encode_call(method, args, kwargs)
    timeout = _timeout_s if _timeout_s is not None else self.timeout_s
    if encoded.unary is not None:
      # Small messages are not paced: HTTP/2 interleaves them with a stream's frames, so a
      # train-by-key call never queues behind a stage's payload.
      reply = await self._unary(encoded.unary, timeout=timeout)
    else:
      reply = await self._stream(self._messages(encoded), timeout=timeout)
    return wire.decode_reply(method, reply)

  async def _messages(self, encoded: wire.EncodedCall) -> AsyncIterator[bytes]:
    yield encoded.header
    for view in wire.iter_chunks(encoded.buffers):
      await self.pacer.transmit(view.nbytes)
      yield bytes(view)  # grpc sends bytes only; a 4 MiB memcpy into reused heap memory

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
