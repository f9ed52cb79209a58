"""The embedded host's calls on the production wire (the request encoding, the bulk format, tunix's
error envelope), the emulated link, and the gRPC service over real loopback (no JAX)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import pickle
import threading
import time

import numpy as np
import pytest

from tests.embedded.support import no_new_threads
from tunix_stage_plugin.transport import listener as buffers_lib
from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import pacing
from tunix_stage_plugin.lab.embedded import server as server_lib
from tunix_stage_plugin.transport import wire

MIB = 1 << 20


def _roundtrip(args, kwargs):
  """A call as the client encodes it and the trainer decodes it: whole when small, else its bulk
  header and its parts received into pooled buffers (as the bulk channel does)."""
  encoded = wire.encode(None, "m", args, kwargs)
  if not client_lib._bulk(encoded):  # pylint: disable=protected-access
    return encoded, None, wire.decode(wire.encode_whole(None, "m", args, kwargs))[2:]
  transfer = wire.new_transfer_id()
  message = encoded.header(transfer)
  header = wire.decode_header(message)
  received = buffers_lib.HostBufferPool().take_all(header.sizes)
  for buffer, view in zip(received, encoded.parts):
    buffer[:] = np.frombuffer(view, np.uint8)
  return encoded, (message, transfer), wire.decode_received(header, received)[2:]


def test_small_call_is_one_unary_message():
  encoded, bulk, (args, kwargs) = _roundtrip((np.arange(10),), {"k": "v"})
  assert bulk is None and encoded.out_of_band_bytes <= client_lib.UNARY_MAX_BYTES
  np.testing.assert_array_equal(args[0], np.arange(10))
  assert kwargs == {"k": "v"}


def test_large_arrays_travel_out_of_band_and_come_back_aligned():
  rng = np.random.default_rng(0)
  big = rng.random((3, MIB), dtype=np.float32)  # 12 MiB: three full chunks
  odd = rng.integers(0, 100, 5 * MIB + 3, dtype=np.uint8)  # a short last chunk
  encoded, (header, transfer), (args, kwargs) = _roundtrip((big,), {"odd": odd, "tag": "x"})
  assert len(header) < 4096  # the pickle holds no array bytes
  sizes = [c.nbytes for c in wire.iter_chunks(encoded.parts)]
  assert sizes == [wire.CHUNK_BYTES] * 3 + [wire.CHUNK_BYTES, MIB + 3]
  np.testing.assert_array_equal(args[0], big)
  np.testing.assert_array_equal(kwargs["odd"], odd)
  for array in (args[0], kwargs["odd"]):
    assert array.ctypes.data % wire.ALIGNMENT == 0
    assert array.flags.writeable
  assert len(transfer) == wire.TRANSFER_ID_BYTES
  assert _roundtrip((big,), {})[1][1] != transfer  # fresh for every call


class FakeClock:
  """A pacer's clock and sleep with no real time: a sleep moves the clock (the code under test
  only reads the clock and awaits the sleep)."""

  def __init__(self) -> None:
    self.now = 0.0
    self.slept: list[float] = []

  def __call__(self) -> float:
    return self.now

  async def sleep(self, seconds: float) -> None:
    self.slept.append(seconds)
    self.now += seconds


def paced(rate: float) -> tuple[pacing.LinkPacer, FakeClock]:
  clock = FakeClock()
  return pacing.LinkPacer(rate, clock=clock, sleep=clock.sleep), clock


def test_link_pacer_serialises_chunks_at_the_bandwidth():
  pacer, clock = paced(100.0)

  async def go():
    for n in (50, 100, 50):
      await pacer.transmit(n)

  asyncio.run(go())
  assert clock.slept == [0.5, 1.0, 0.5]
  assert clock.now == 2.0  # 200 bytes at 100 B/s


def test_link_pacer_absorbs_the_senders_own_hand_over_time_but_not_idle_gaps():
  pacer, clock = paced(100.0)

  async def go():
    for _ in range(4):
      await pacer.transmit(100)  # 1 s per chunk
      clock.now += 0.25  # the sender spends 0.25 s handing the chunk over
    assert clock.now == 4.25  # not 5.0: hand-overs overlap the link's next chunk
    clock.now += 3.0  # idle: the next transfer starts when it is sent
    await pacer.transmit(100)
    assert clock.now == 8.25

  asyncio.run(go())


def test_link_pacer_sleeps_only_once_the_sender_is_a_few_milliseconds_ahead():
  """The loop sleeps in whole milliseconds: a fast link paced per chunk would lose a millisecond
  per chunk. Small leads accumulate instead, and the total sleep is still the link's time."""
  pacer, clock = paced(1e9)

  async def go():
    for _ in range(100):
      await pacer.transmit(100_000)  # 0.1 ms each

  asyncio.run(go())
  slept = clock.slept
  assert all(s >= pacing.MIN_SLEEP_S for s in slept) and 4 <= len(slept) <= 5
  # 10 ms of link time in all: slept, but for a last lead shorter than MIN_SLEEP_S.
  assert 0.01 - pacing.MIN_SLEEP_S <= sum(slept) <= 0.01 + 1e-9


def test_link_pacer_shares_the_link_between_concurrent_senders():
  now = [0.0]
  waits = []

  async def fake_sleep(seconds):
    waits.append(seconds)

  pacer = pacing.LinkPacer(10.0, clock=lambda: now[0], sleep=fake_sleep)

  async def go():
    await asyncio.gather(pacer.transmit(10), pacer.transmit(10))

  asyncio.run(go())
  assert sorted(waits) == [1.0, 2.0]  # the second queues behind the first


def test_link_pacer_rejects_a_bad_rate_and_unpaced_never_sleeps():
  with pytest.raises(ValueError, match="bandwidth must be > 0"):
    pacing.LinkPacer(0)

  async def never(_):
    raise AssertionError("an unpaced link must not sleep")

  asyncio.run(pacing.LinkPacer(None, sleep=never).transmit(10 ** 9))
  assert pacing.SharedLink(None).transfer(10 ** 9, 0.0) == 0.0


@pytest.mark.parametrize("address", ["", "localhost", "127.0.0.1:0", "127.0.0.1:70000",
                                     "127.0.0.1:80 ", "http://127.0.0.1:80"])
def test_bad_trainer_addresses_are_named(address):
  with pytest.raises(ValueError, match="HOST:PORT"):
    client_lib.check_address(address)


class _Echo:
  """A served object: which thread ran what, and a gate to hold the compute lane."""

  METHODS = frozenset({"heartbeat", "digest", "boom", "hold", "stage_batch"})

  def __init__(self):
    self.gate = threading.Event()
    self.holding = threading.Event()

  def heartbeat(self):
    return {"time": 0.0, "thread": threading.current_thread().name}

  def digest(self, array, *, label):
    return {"sha": hashlib.sha256(array.tobytes()).hexdigest(), "label": label,
            "aligned": array.ctypes.data % wire.ALIGNMENT == 0,
            "thread": threading.current_thread().name}

  def stage_batch(self):
    return threading.current_thread().name

  def boom(self):
    raise ValueError("bad value 7; accepted: 1..6")

  def hold(self):
    self.holding.set()
    if not self.gate.wait(60):
      raise TimeoutError("the test never released the compute lane")
    return "released"


async def _serve(echo):
  executor = executor_lib.MethodExecutor(staging_methods=contract.STAGING_METHODS,
                                         light_methods=contract.LIGHT_METHODS, name="echo")
  server = server_lib.WorkerServer(echo, executor)
  port = await server.start(0)
  return server, executor, f"127.0.0.1:{port}"


def test_calls_over_real_grpc_use_the_lanes_stream_big_payloads_and_shut_down_cleanly():
  echo = _Echo()
  payload = np.random.default_rng(1).integers(0, 255, 20 * MIB, dtype=np.uint8)

  async def go():
    server, executor, address = await _serve(echo)
    try:
      async with client_lib.WorkerClient(address) as client:
        # 20 MiB exceeds the 16 MiB message cap: it only arrives on the bulk channel.
        got = await client.call("digest", payload, label="big")
        assert got["sha"] == hashlib.sha256(payload.tobytes()).hexdigest()
        assert got["aligned"] and got["label"] == "big"
        assert got["thread"].startswith("echo-compute")
        assert (await client.call("stage_batch")).startswith("echo-staging")
        assert (await client.call("heartbeat"))["thread"] == "MainThread"  # inline lane
        # tunix's envelope: the type, the message, then the remote traceback naming the method.
        with pytest.raises(contract.RemoteError, match=r"^RemoteExecutionError \[ValueError\]: "
                           r"bad value 7; accepted: 1\.\.6\n(?s:.*), in boom\n"):
          await client.call("boom")
        with pytest.raises(contract.RemoteError, match=r"\[AttributeError\]: unknown method "
                           "'nope'; accepted"):
          await client.call("nope")
        # A held compute lane does not hold the event loop: a heartbeat still answers.
        held = asyncio.ensure_future(client.call("hold"))
        await asyncio.get_running_loop().run_in_executor(None, echo.holding.wait, 60)
        assert (await asyncio.wait_for(client.call("heartbeat"), 60))["thread"] == "MainThread"
        echo.gate.set()
        assert await held == "released"
    finally:
      await server.stop(0)
      executor.close()

  with no_new_threads():
    asyncio.run(go())


def test_a_port_in_use_is_refused_not_shared():
  async def go():
    first, executor, address = await _serve(_Echo())
    second = server_lib.WorkerServer(_Echo(), executor)
    try:
      with pytest.raises(OSError, match=f"could not bind {address}: in use"):
        await second.start(int(address.rsplit(":", 1)[1]))
    finally:
      await second.stop(0)
      await first.stop(0)
      executor.close()

  asyncio.run(go())


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net")
def test_server_listens_on_127_0_0_1_only():
  async def go():
    server, executor, address = await _serve(_Echo())
    try:
      port = int(address.rsplit(":", 1)[1])
      listening = []
      for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
          with open(table, encoding="ascii") as f:
            for line in f.readlines()[1:]:
              local, state = line.split()[1], line.split()[3]
              host, hex_port = local.rsplit(":", 1)
              if state == "0A" and int(hex_port, 16) == port:
                listening.append(host)
      # 127.0.0.1 (little-endian hex), as IPv4 or IPv4-mapped IPv6; never 0.0.0.0 or [::].
      loopback = {"0100007F", "0000000000000000FFFF00000100007F"}
      assert listening and set(listening) <= loopback, listening
    finally:
      await server.stop(0)
      executor.close()

  asyncio.run(go())


def test_a_calls_deadline_is_its_expected_time_plus_the_liveness_bound():
  async def go():
    async with client_lib.WorkerClient("127.0.0.1:9", wire_bytes_per_s=10e6,
                                       liveness_s=30) as client:
      small = wire.encode(None, "fwd_bwd", (), {"stage_key": "k"})
      assert client.expected_s(small) == client_lib.CALL_BASE_S
      big = wire.encode(None, "fwd_bwd", (np.zeros(20_000_000, np.uint8),), {})
      assert client.expected_s(big) == pytest.approx(client_lib.CALL_BASE_S + 2.0, abs=0.01)
      # Bytes already queued on the link come first: 50 MB sent, none of it across yet.
      async def no_time_passes(_):
        pass

      client.pacer = pacing.LinkPacer(10e6, clock=lambda: 100.0, sleep=no_time_passes)
      await client.pacer.transmit(50_000_000)
      assert client.expected_s(big) == pytest.approx(client_lib.CALL_BASE_S + 7.0, abs=0.01)
      sync = wire.encode(None, "weight_sync", (45.0,), {})
      assert client.expected_s(sync, (45.0,)) == client_lib.CALL_BASE_S + 45.0
      assert ("grpc.keepalive_time_ms", 7500) in client_lib.keepalive_options(30)
      assert ("grpc.keepalive_time_ms", 1000) in client_lib.keepalive_options(1)
    with pytest.raises(ValueError, match="accepted a number of seconds >= 1; got 0"):
      client_lib.WorkerClient("127.0.0.1:9", liveness_s=0)

  asyncio.run(go())


def test_a_header_with_bad_sizes_or_transfer_id_is_refused():
  transfer = bytes(wire.TRANSFER_ID_BYTES)
  header = pickle.dumps({"method": "m", "body": b"", "sizes": [4, -1], "transfer": transfer})
  with pytest.raises(wire.WireError, match="list of integers >= 0"):
    wire.decode_header(header)
  with pytest.raises(wire.WireError, match="16-byte transfer id"):
    wire.decode_header(pickle.dumps({"method": "m", "body": b"", "sizes": [4],
                                       "transfer": b"x"}))
  with pytest.raises(wire.WireError, match="must be its header"):
    wire.decode_header(pickle.dumps({"method": "m", "body": b"", "sizes": [4]}))
  ok = wire.decode_header(pickle.dumps({"method": "m", "body": b"", "sizes": [4, 8],
                                          "transfer": transfer}))
  assert wire.announced_bytes(ok, 12, server_lib.CAP_SETTING) == 12
  with pytest.raises(wire.WireError, match=r"m announces 12 bytes \(0.0 MiB\), above this "
                     r"trainer's 11-byte cap on one call \(trainer_main --max_call_mib\)"):
    wire.announced_bytes(ok, 11, server_lib.CAP_SETTING)


def test_one_shared_link_queues_overlapping_copies():
  """Two threads copying at once on one emulated host-to-device link take as long as the two
  copies one after the other (not two links at full speed). Sleeps here are the emulated link."""
  link = pacing.SharedLink(100e6)  # 0.1 s per 10 MB
  started = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    list(pool.map(lambda _: link.transfer(10 ** 7, time.perf_counter()), range(2)))
  assert time.perf_counter() - started >= 0.2
  with pytest.raises(ValueError, match="bandwidth must be > 0"):
    pacing.SharedLink(0)


def test_link_pacer_lets_a_sender_catch_up_after_one_slow_hand_over():
  """A chunk that took longer than its slot to hand over (a few ms) does not put the link behind
  for the rest of the transfer: the next chunks go at once until the sender is on schedule."""
  pacer, clock = paced(1e9)  # 4 ms per 4 MB

  async def go():
    for i in range(10):
      await pacer.transmit(4_000_000)
      clock.now += 0.010 if i == 2 else 0.001  # one hand-over of 10 ms, the others 1 ms
  asyncio.run(go())
  assert clock.now == pytest.approx(0.040 + 0.001, abs=1e-9)  # 10 slots, not 10 slots + 6 ms
