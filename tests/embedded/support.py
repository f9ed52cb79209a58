"""Helpers for the embedded-host tests: run a plan against a real trainer over real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pickle
import socket
import struct
import threading
import time
from typing import Any, Callable, Iterator

import grpc

from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import job as job_lib
from tunix_stage_plugin.lab.embedded import server as server_lib
from tunix_stage_plugin.transport import wire

TINY = data_lib.TINY_SIZES


@dataclasses.dataclass
class PlanResult:
  outcomes: list[job_lib.StepOutcome]
  finish: dict[str, Any]
  wire: client_lib.WireStats | None = None

  @property
  def fallbacks(self) -> list[int]:
    return [o.report.fallbacks for o in self.outcomes]


async def run_plan_async(address: str, plan: job_lib.JobPlan, *,
                         sizes: data_lib.Sizes = TINY, seed: int = 0,
                         engine: Callable[[client_lib.WorkerClient], client_lib.EmbeddedEngine]
                         = client_lib.EmbeddedEngine,
                         **setup: Any) -> PlanResult:
  async with client_lib.WorkerClient(address) as client:
    await client.wait_ready()
    await client.call("setup", sizes=sizes.as_dict(), seed=seed, **setup)
    the_engine = engine(client)
    outcomes = await job_lib.run_job(
        the_engine, plan,
        data_lib.BatchMaker(sizes, seed))
    return PlanResult(outcomes, await client.call("finish"), the_engine.wire)


def run_plan(address: str, plan: job_lib.JobPlan, **kwargs: Any) -> PlanResult:
  return asyncio.run(run_plan_async(address, plan, **kwargs))


def call(address: str, method: str, *args: Any, **kwargs: Any) -> Any:
  async def go() -> Any:
    async with client_lib.WorkerClient(address) as client:
      return await client.call(method, *args, **kwargs)
  return asyncio.run(go())


def _warm_grpc_aio() -> None:
  """grpcio starts one process-wide aio poller thread on first use and never joins it."""
  async def go() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    await channel.close()
  asyncio.run(go())


@contextlib.contextmanager
def no_new_threads() -> Iterator[None]:
  """Fails if the block leaves a Python thread behind (grpcio's own poller excepted, see above)."""
  _warm_grpc_aio()
  before = set(threading.enumerate())
  yield
  left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
  assert not left, f"threads left running: {left}"


def inline_digest_of(address: str, steps: int, microbatches: int, **kwargs: Any) -> str:
  """The parameter digest of an inline run (every micro-batch with its train call): the
  reference every staged run must reach."""
  result = run_plan(address, job_lib.JobPlan(steps, microbatches, kind="inline"), **kwargs)
  assert result.finish["trained_order"] == data_lib.expected_order(steps, microbatches)
  return result.finish["param_digest"]


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
  """Polls `predicate` until it is true (returns its value) or `timeout_s` passes (fails)."""
  deadline = time.monotonic() + timeout_s
  while True:
    value = predicate()
    if value:
      return value
    if time.monotonic() > deadline:
      raise AssertionError(f"{what}: not within {timeout_s:g} s")
    time.sleep(0.05)  # a polling interval, not a synchronisation


def process_state(pid: int) -> str:
  """The process's state letter from /proc (R, S, T for stopped, Z, ...)."""
  with open(f"/proc/{pid}/stat", encoding="ascii") as f:
    return f.read().rsplit(")", 1)[1].split()[0]


# --- bulk calls made by hand (a misbehaving peer's view of the trainer) ---------------------------


def bulk_header(method: str, sizes: list[int], transfer: bytes) -> bytes:
  """A bulk call's gRPC header for `method()` (no arguments) announcing `sizes`."""
  body = wire.encode(None, method, (), {}).body
  return pickle.dumps({"method": method, "body": body, "sizes": sizes, "transfer": transfer},
                      protocol=5)


def bulk_frame(transfer: bytes, sizes: list[int], payload: bytes = b"") -> bytes:
  return (wire.FRAME_HEADER.pack(wire.MAGIC, transfer, len(sizes))
          + struct.pack(f"<{len(sizes)}Q", *sizes) + payload)


def bulk_connection(port: int) -> socket.socket:
  """A raw connection to a bulk listener, its greeting read (as a sender does)."""
  sock = socket.create_connection(("127.0.0.1", port))
  sock.settimeout(10)
  assert sock.recv(1) == wire.ACCEPTED
  return sock


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
  """True once the peer closed the connection within `timeout_s` (an end of stream, or a reset
  when it closed with bytes of ours unread); what it sent before is read and dropped."""
  sock.settimeout(timeout_s)
  try:
    while sock.recv(1 << 16):
      pass
  except ConnectionResetError:
    pass
  except TimeoutError:
    return False
  return True


async def bulk_port(channel: grpc.aio.Channel) -> int:
  announced = await channel.unary_unary(server_lib.BULK_PORT)(b"", timeout=10)
  port, _ = wire.read_announcement(announced)
  return port


async def bulk_connect(port: int) -> socket.socket:
  """bulk_connection for an event loop: a non-blocking socket, its greeting read."""
  loop = asyncio.get_running_loop()
  sock = socket.socket()
  sock.setblocking(False)
  try:
    await loop.sock_connect(sock, ("127.0.0.1", port))
    assert await loop.sock_recv(sock, 1) == wire.ACCEPTED
  except BaseException:
    sock.close()
    raise
  return sock


async def raw_bulk_call(address: str, header: bytes, frame: bytes,
                        timeout: float | None = 20) -> Any:
  """A bulk call made by hand: its header on gRPC, `frame` (whatever it holds) on the bulk port."""
  async with grpc.aio.insecure_channel(address, options=server_lib.grpc_options()) as channel:
    loop = asyncio.get_running_loop()
    sock = await bulk_connect(await bulk_port(channel))
    try:
      call_bulk = channel.unary_unary(server_lib.CALL_BULK)
      answer = asyncio.ensure_future(call_bulk(header, timeout=timeout))
      with contextlib.suppress(OSError):  # the trainer may drop the connection mid-frame
        await loop.sock_sendall(sock, frame)
      reply = await answer
    finally:
      sock.close()
  return client_lib.decode_reply(reply)
