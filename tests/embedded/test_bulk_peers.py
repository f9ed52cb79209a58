"""The bulk channel under misbehaving and busy peers, against a real trainer process (issue 29).

Every call ends with its own clear answer, never only its deadline, whatever another peer sends;
idle connections are dropped; a client refused at the connection cap is told so at once. The
misbehaving peers speak to the trainer's gRPC service and bulk port by hand (raw headers, raw
sockets); the busy one is a real WorkerClient. docs/embedded.md "Limits of the bulk channel".
"""

from __future__ import annotations

import asyncio
import re
import secrets
from typing import Any, Iterator, Sequence

import grpc
import pytest

from tests.embedded.support import (bulk_connect, bulk_connection, bulk_frame, bulk_header,
                                    bulk_port, call, closed_by_peer, raw_bulk_call, wait_for)
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import process as process_lib
from tunix_stage_plugin.lab.embedded import server as server_lib
from tunix_stage_plugin.transport import wire

MIB = 1 << 20
LIMITS = wire.BulkLimits()  # what trainer_main enforces
SIZES = data_lib.TINY_SIZES.with_payload_mib(2)  # a micro-batch travels on the bulk channel
DEPTH = 64  # every call of a test below may stay staged at once
GUARD_S = 60  # a hang guard, not a timing assertion: the base code waited forever here


class Trainer:
  """The module's trainer process, its stderr log and its bulk port."""

  def __init__(self, proc: process_lib.TrainerProcess, log_path: str) -> None:
    self.proc, self.address, self.log_path = proc, proc.address, log_path

  def log(self) -> str:
    with open(self.log_path, encoding="utf-8", errors="replace") as f:
      return f.read()

  def port(self) -> int:
    async def go() -> int:
      async with grpc.aio.insecure_channel(self.address) as channel:
        return await bulk_port(channel)
    return asyncio.run(go())


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> Iterator[Trainer]:
  """A set-up trainer whose staging depth holds every call below; logs at INFO to a file."""
  log_path = str(tmp_path_factory.mktemp("trainer") / "stderr.log")
  with open(log_path, "w", encoding="utf-8") as log:
    with process_lib.TrainerProcess(max_device_batches=DEPTH, max_host_batches=DEPTH,
                                    extra_args=["--log_level", "INFO"], stderr=log) as proc:
      call(proc.address, "setup", sizes=SIZES.as_dict(), record_timeline=False)
      yield Trainer(proc, log_path)
  assert proc.proc.returncode == 0


def _pool_in_use(address: str) -> int:
  memory = call(address, "memory")
  return memory["pool_held_bytes"] - memory["pool_idle_bytes"]


async def _stage_all(address: str, batches: Sequence[data_lib.Batch], tag: str,
                     **client_args: Any) -> tuple[list[Any], int]:
  """Stages every batch at once from one new client; returns each call's answer (or error) and
  the bytes the client handed to its bulk connections. The staged keys are reset after."""
  keys = [f"{tag}-{i}" for i in range(len(batches))]
  async with client_lib.WorkerClient(address, **client_args) as client:
    answers = await asyncio.wait_for(asyncio.gather(
        *(client.call("stage_batch", b, key=k) for b, k in zip(batches, keys)),
        return_exceptions=True), GUARD_S)
    staged = [k for k, a in zip(keys, answers) if isinstance(a, dict) and a["status"] == "staged"]
    if staged:
      assert sorted(await client.call("reset_staged", staged)) == sorted(staged)
    return answers, client.bulk_sent_bytes


def _batches(step: int, count: int) -> list[data_lib.Batch]:
  make = data_lib.BatchMaker(SIZES, 0)
  return [make(step, i) for i in range(count)]


def test_a_call_whose_bytes_never_come_or_stall_ends_on_the_trainers_own_bound(trainer):
  """A header sent without a gRPC deadline whose frame never begins, and a frame that stalls
  mid-buffer: each call fails with its own error after the bulk channel's bound, the stalled
  frame's connection is dropped and its pooled buffer goes back to the pool. Before: both calls
  waited forever, the stalled frame holding its thread and buffer."""
  in_use = _pool_in_use(trainer.address)
  never, stalled = (secrets.token_bytes(wire.TRANSFER_ID_BYTES) for _ in range(2))

  async def go() -> tuple[list[bytes], bool]:
    async with grpc.aio.insecure_channel(trainer.address,
                                         options=server_lib.grpc_options()) as channel:
      call_bulk = channel.unary_unary(server_lib.CALL_BULK)
      sock = await bulk_connect(await bulk_port(channel))
      try:
        loop = asyncio.get_running_loop()
        sending = asyncio.ensure_future(  # a frame of 16 MiB: its first MiB, then nothing
            loop.sock_sendall(sock, bulk_frame(stalled, [16 * MIB], bytes(MIB))))
        replies = await asyncio.wait_for(asyncio.gather(
            call_bulk(bulk_header("heartbeat", [MIB], never)),  # no deadline of its own
            call_bulk(bulk_header("heartbeat", [16 * MIB], stalled))), GUARD_S)
        await sending
        sock.setblocking(True)
        return replies, closed_by_peer(sock, 10)
      finally:
        sock.close()

  (never_reply, stalled_reply), dropped = asyncio.run(go())
  with pytest.raises(contract.RemoteError, match=(
      rf"\[WireError\]: no bulk frame for this call began within {LIMITS.pair_wait_s:g} s of its "
      r"header \(BulkLimits.pair_wait_s\): its bytes never arrived on the bulk channel")):
    client_lib.decode_reply(never_reply)
  with pytest.raises(contract.RemoteError, match=(
      rf"\[WireError\]: the bulk frame stalled after 1048576 of its 16777216 bytes: none came for "
      rf"{LIMITS.stall_s:g} s \(BulkLimits.stall_s\)")):
    client_lib.decode_reply(stalled_reply)
  assert dropped
  assert _pool_in_use(trainer.address) <= in_use


MAX = wire.MAX_BUFFERS


@pytest.mark.parametrize("header_sizes,frame,error", [
    ([0] * (MAX + 1), lambda t: bulk_frame(t, [0] * (MAX + 1)),
     rf"heartbeat announces {MAX + 1} buffers, above the {MAX} one call may carry; refused "
     "before reading any of its bytes"),
    ([MIB], lambda t: wire.FRAME_HEADER.pack(wire.MAGIC, t, MAX + 1),
     rf"its bulk frame was refused: it announced {MAX + 1} buffers; a frame carries at most "
     rf"{MAX}"),
    ([MIB], lambda t: wire.FRAME_HEADER.pack(b"XXXX", t, 1) + bytes(8 + MIB),
     r"its bulk frame was refused: not a bulk frame header \(magic b'XXXX'\)"),
], ids=["header_buffers", "frame_buffers", "frame_magic"])
def test_a_refused_header_or_frame_is_answered_on_its_own_call(trainer, header_sizes, frame,
                                                               error):
  """Before: each of these waited its call's whole deadline (the frame was dropped as "not a frame
  header", the call never heard of it)."""
  transfer = secrets.token_bytes(wire.TRANSFER_ID_BYTES)
  with pytest.raises(contract.RemoteError, match=rf"\[WireError\]: {error}"):
    asyncio.run(raw_bulk_call(trainer.address, bulk_header("heartbeat", header_sizes, transfer),
                              frame(transfer), timeout=GUARD_S))
  assert call(trainer.address, "heartbeat")["pid"] == trainer.proc.pid


def test_a_header_reusing_an_id_in_flight_is_refused_and_leaves_the_other_call_alone(trainer):
  """Before: the refused header's cleanup ended the other call's transfer, which then got no reply
  at all and waited its deadline."""
  transfer = secrets.token_bytes(wire.TRANSFER_ID_BYTES)
  header = bulk_header("heartbeat", [MIB], transfer)

  async def go() -> tuple[bytes, Any]:
    async with grpc.aio.insecure_channel(trainer.address,
                                         options=server_lib.grpc_options()) as channel:
      call_bulk = channel.unary_unary(server_lib.CALL_BULK)
      calls = [asyncio.ensure_future(call_bulk(header, timeout=GUARD_S)) for _ in range(2)]
      done, _ = await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
      refused = done.pop()
      waiting = calls[1] if refused is calls[0] else calls[0]
      with bulk_connection(await bulk_port(channel)) as sock:  # the bytes of the call that holds it
        sock.sendall(bulk_frame(transfer, [MIB], bytes(MIB)))
        return refused.result(), client_lib.decode_reply(await waiting)

  refused, answer = asyncio.run(go())
  with pytest.raises(contract.RemoteError, match="a bulk transfer id was used twice"):
    client_lib.decode_reply(refused)
  assert answer["pid"] == trainer.proc.pid




def test_a_client_refused_at_the_connection_cap_is_told_at_once_and_the_trainer_logs_it(trainer):
  """Another client holds every connection the trainer allows: a call fails at once with the
  refusal naming the cap, the trainer logs it, and once they close the next call passes. Before:
  the listener closed the extra connection without a word, the small frame looked sent, and the
  call waited its whole deadline to report an unresponsive trainer."""
  port = trainer.port()
  holders = [bulk_connection(port) for _ in range(LIMITS.max_connections)]
  try:
    (refused,), _ = asyncio.run(_stage_all(trainer.address, _batches(0, 1), "capped"))
  finally:
    for sock in holders:
      sock.close()
  assert isinstance(refused, wire.WireError), refused
  assert re.fullmatch(
      rf"the trainer's bulk listener at 127.0.0.1:{port} refused a connection: \d+ bulk "
      r"connections are open, this trainer's cap \(BulkLimits.max_connections\); one client "
      "queues its sends within it, so the others are held by other clients", str(refused))
  wait_for(lambda: "refused a bulk connection from 127.0.0.1:" in trainer.log(), 10,
           "the trainer's log line for the refused connection")
  (answer,), _ = asyncio.run(_stage_all(trainer.address, _batches(0, 1), "after-cap"))
  assert isinstance(answer, dict) and answer["status"] == "staged", answer


def test_idle_and_half_sent_connections_are_dropped_and_an_honest_call_then_passes(trainer):
  """Connections that send nothing, or half a frame header, are dropped after the header wait.
  Before: they were never dropped, and while they held the cap honest calls failed."""
  port = trainer.port()
  idle = [bulk_connection(port) for _ in range(LIMITS.max_connections)]
  try:
    for sock in idle[::2]:
      sock.sendall(wire.MAGIC + bytes(6))  # 10 bytes of a frame header
    dropped = [closed_by_peer(sock, LIMITS.header_wait_s + 20) for sock in idle]
  finally:
    for sock in idle:
      sock.close()
  assert all(dropped), dropped.count(False)
  for sent in (0, 10):
    assert (f"closed a bulk connection: {sent} of the {wire.FRAME_HEADER.size} bytes of a frame "
            f"header, due within {LIMITS.header_wait_s:g} s") in trainer.log()
  (answer,), _ = asyncio.run(_stage_all(trainer.address, _batches(1, 1), "after-idle"))
  assert isinstance(answer, dict) and answer["status"] == "staged", answer


def test_one_client_with_more_calls_in_flight_than_the_cap_queues_them_and_all_are_staged(
    trainer):
  """48 stages in flight on one client, over an emulated link so their sends overlap: the client
  sends on at most the trainer's cap of connections at once, the others wait for one. Before: 48
  connections, 16 closed at accept, and some of their calls waited their whole deadline."""
  batches = _batches(2, LIMITS.max_connections + 16)
  answers, sent = asyncio.run(_stage_all(trainer.address, batches, "deep",
                                         wire_bytes_per_s=200e6, liveness_s=10))
  assert [a["status"] if isinstance(a, dict) else a for a in answers] == ["staged"] * len(batches)
  assert sent == sum(b.nbytes for b in batches)


def test_concurrent_first_bulk_calls_of_a_client_share_one_sender(trainer):
  """Before: each concurrent first call made its own BulkSender; all but the last were dropped
  with their connections open, and bulk_sent_bytes counted only the last one's bytes."""
  batches = _batches(3, 6)
  answers, sent = asyncio.run(_stage_all(trainer.address, batches, "first"))
  assert [a["status"] if isinstance(a, dict) else a for a in answers] == ["staged"] * len(batches)
  assert sent == sum(b.nbytes for b in batches)


def test_a_frame_slower_than_the_stall_bound_on_an_emulated_link_keeps_coming(trainer):
  """A micro-batch whose emulated wire time exceeds the stall bound: the sender paces it in
  chunks of at most pacing.PACED_CHUNK_S of link time, so its bytes never pause that long."""
  batches = _batches(4, 1)
  rate = batches[0].nbytes / (LIMITS.stall_s + 1)
  (answer,), _ = asyncio.run(_stage_all(trainer.address, batches, "slow", wire_bytes_per_s=rate))
  assert isinstance(answer, dict) and answer["status"] == "staged", answer
