"""The bulk side channel on tunix's host, against tunix's real gRPC server and handle in one
process, over real sockets on 127.0.0.1 (the two-process jobs are in test_grpc.py).

The server hosts a real TrainerWorker whose trainer records what it was given and on which
thread (test_stream.RecordingTrainer). tunix's cap is the upstream 128 MiB: every payload here is
under it, so without the side channel each call would be tunix's own unary call.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import struct
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

from tunix.experimental.orchestrator import distributed_rl_engine  # pylint: disable=wrong-import-position

# pylint: disable-next=unused-import  (cap: a fixture)
from tests.hosts.tunix.test_stream import ACTOR, MIB, big, cap, close, new_worker, serve
from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core.contract import StageStatus
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.hosts.tunix import orchestrator
from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER
from tunix_stage_plugin.transport import wire

pytestmark = pytest.mark.tunix


@pytest.fixture
def staging():
  manager.uninstall("tunix", quiet=True)
  assert manager.install(config_lib.resolve({"mode": "stage"}, env={}), quiet=True).installed
  yield ADAPTER.installation
  manager.uninstall("tunix", quiet=True)


def test_a_stage_and_an_inline_train_call_travel_the_side_channel(staging, caplog):
  caplog.set_level(logging.INFO, logger="tunix_stage_plugin")
  worker = new_worker()
  staged, inline = big(1, mib=8), big(2, mib=8)

  async def main():
    server, handle, engine = await serve(worker)
    assert server in staging.trainer_side().side_channels
    router = ADAPTER.installation.orchestrator_side()
    try:
      outcome = await engine.stage_train_batch(staged, key="b-1")
      await engine.train_step(None, role=ACTOR, apply_optimizer=False, stage_key="b-1")
      trained = await router.train(engine, inline, stage_key=None,
                                       apply_optimizer=True)
    finally:
      await close(server, handle, engine)
    return outcome, trained.result, router

  outcome, result, router = asyncio.run(main())
  assert outcome.status is StageStatus.STAGED
  assert staging.trainer_side().bulk_calls == {"stage_batch": 1, "fwd_bwd": 1} and not staging.trainer_side().chunked_calls
  (placed, _, _), (payload, kwargs, thread) = worker._trainer.fwd  # pylint: disable=protected-access
  np.testing.assert_array_equal(np.asarray(placed["experts"]), staged["experts"])
  np.testing.assert_array_equal(payload["experts"], inline["experts"])
  assert kwargs == {} and thread.startswith("trainer-compute")  # the executor's compute lane
  assert payload["experts"].ctypes.data % 64 == 0 and payload["experts"].flags.writeable
  assert result["updated"] is True and result["fwd_bwd"].metadata["queued"] is True
  assert router.calls[contract.SIDE_CHANNEL] == 2 and router.calls[contract.STREAM] == 0
  lines = [r.getMessage() for r in caplog.records if "side channel" in r.getMessage()]
  assert len(lines) == 1 and lines[0].startswith("tunix-stage: bulk side channel to 127.0.0.1:")
  assert lines[0].endswith("for micro-batch calls >= 1 MiB"), lines


def test_below_the_threshold_the_call_is_the_hosts_own(staging):
  worker = new_worker()
  small = big(mib=1)
  small["experts"] = small["experts"][:-64]  # with the tokens, just under orchestrator.SIDE_MIN_BYTES

  async def main():
    server, handle, engine = await serve(worker)
    router = ADAPTER.installation.orchestrator_side()
    host = distributed_rl_engine.DistributedRLEngine.train_step
    try:
      with mock.patch.object(distributed_rl_engine.DistributedRLEngine, "train_step",
                             autospec=True, side_effect=host) as train_step:
        await orchestrator.StagingCalls(router, engine).train(small, stage_key=None,
                                                               apply_optimizer=False)
    finally:
      await close(server, handle, engine)
    return train_step

  train_step = asyncio.run(main())
  assert train_step.call_args_list == [mock.call(mock.ANY, small, role=ACTOR,
                                                 accumulate_gradients=True,
                                                 apply_optimizer=False)]
  assert not staging.trainer_side().bulk_calls and not staging.trainer_side().chunked_calls


def test_a_trainer_without_a_side_channel_is_asked_once_and_said_in_one_line(staging, caplog):
  caplog.set_level(logging.INFO, logger="tunix_stage_plugin")
  staging.serve_side_channel = False  # as a trainer without the plugin answers
  worker = new_worker()

  async def main():
    server, handle, engine = await serve(worker)
    router = ADAPTER.installation.orchestrator_side()
    try:
      with mock.patch.object(handle, "asubmit", wraps=handle.asubmit) as asubmit:
        for seed in range(3):
          await router.call(engine, handle, "fwd_bwd", payload=big(seed, mib=2))
    finally:
      await close(server, handle, engine)
    return [c.args[0] for c in asubmit.call_args_list]

  methods = asyncio.run(main())
  assert methods == [contract.SIDE_PORT] + ["fwd_bwd"] * 3  # asked once; then tunix's own calls
  lines = [r.getMessage() for r in caplog.records if "side channel" in r.getMessage()]
  assert len(lines) == 1 and lines[0].startswith("tunix-stage: no side channel on 127.0.0.1:")
  assert lines[0].endswith("calls over the 128 MiB cap use the chunked stream"), lines
  assert not staging.trainer_side().bulk_calls and len(worker._trainer.fwd) == 3  # pylint: disable=protected-access


def test_a_side_channel_this_process_cannot_reach_leaves_calls_over_the_cap_to_the_stream(
    cap, staging, caplog):
  """The trainer announces its bulk port, but nothing there accepts a connection (as where only
  tunix's own port is open between two pods): said in one line, and a call over tunix's cap
  (lowered to 8 MiB) travels the chunked stream on tunix's port instead, whole."""
  caplog.set_level(logging.INFO, logger="tunix_stage_plugin")
  worker = new_worker()
  sent = big(7)

  async def main():
    server, handle, engine = await serve(worker)
    staging.trainer_side().side_channels[server].listener.close()  # announced still; unreachable now
    router = ADAPTER.installation.orchestrator_side()
    try:
      await router.train(engine, sent, stage_key=None, apply_optimizer=False)
    finally:
      await close(server, handle, engine)
    return router

  router = asyncio.run(main())
  assert router.calls[contract.STREAM] == 1 and router.calls[contract.SIDE_CHANNEL] == 0
  assert staging.trainer_side().chunked_calls == {"fwd_bwd": 1} and not staging.trainer_side().bulk_calls
  (payload, _, _), = worker._trainer.fwd  # pylint: disable=protected-access
  np.testing.assert_array_equal(payload["experts"], sent["experts"])
  lines = [r.getMessage() for r in caplog.records if "side channel" in r.getMessage()]
  assert len(lines) == 1 and lines[0].startswith("tunix-stage: the side channel at 127.0.0.1:")
  assert "cannot be reached from here (ConnectionRefusedError" in lines[0], lines
  assert lines[0].endswith("calls over the 8 MiB cap use the chunked stream"), lines


def test_a_header_whose_bytes_never_come_is_refused_within_the_bound_and_frees_its_buffers(
    staging):
  """The frame's header and its first MiB come on a raw socket, then nothing: the listener's
  stall bound ends the call, the connection is dropped and the 4 MiB buffer is idle again."""
  staging.bulk_limits = wire.BulkLimits(stall_s=0.5)  # read when the server starts
  worker = new_worker()
  payload = big(mib=4)

  async def main():
    server, handle, engine = await serve(worker)
    port, _ = wire.read_announcement(await handle.asubmit(contract.SIDE_PORT))
    encoded = wire.encode(None, "fwd_bwd", (), {"payload": payload, "skip_jit": False})
    transfer = wire.new_transfer_id()
    sizes = [b.nbytes for b in encoded.buffers]
    raw = socket.create_connection(("127.0.0.1", port))
    try:
      assert raw.recv(1) == wire.ACCEPTED  # the listener's greeting
      raw.sendall(wire.FRAME_HEADER.pack(wire.MAGIC, transfer, len(sizes))
                  + struct.pack(f"<{len(sizes)}Q", *sizes) + bytes(encoded.buffers[0][:MIB]))
      with pytest.raises(RuntimeError) as refused:
        await handle.asubmit(contract.SIDE_CALL, header=wire.encode_header(
            "fwd_bwd", encoded.body, encoded.buffers, transfer))
      raw.settimeout(10)
      ended = raw.recv(1) == b""  # the trainer dropped the connection
      await ADAPTER.installation.orchestrator_side().train(engine, big(5, mib=4),
                             stage_key=None, apply_optimizer=False)  # the next works
    finally:
      raw.close()
      await close(server, handle, engine)
    return str(refused.value), ended

  message, ended = asyncio.run(main())
  assert re.match(r"RemoteExecutionError \[WireError\]: the bulk frame stalled after 1048576 of "
                  r"its 41943\d\d bytes: none came for 0\.5 s \(BulkLimits\.stall_s\)", message), message
  assert ended
  assert staging.trainer_side().bulk_calls == {"fwd_bwd": 1} and len(worker._trainer.fwd) == 1  # pylint: disable=protected-access
  # The abandoned transfer's 4 MiB buffer went back to the pool: the next call received into it
  # (the trainer keeps that one's payload).
  assert (staging.trainer_side().pool.made, staging.trainer_side().pool.reused, staging.trainer_side().pool.held_bytes()) == (1, 1, 4 * MIB)


def test_a_side_channel_broken_mid_transfer_fails_the_call_clearly_and_the_next_works(staging):
  """The trainer's receive connection is shut down as its first buffer is taken (a real broken
  connection): the call ends with one clear error, nothing is run, the next call works."""
  worker = new_worker()
  take_all, broken = staging.trainer_side().pool.take_all, []

  def break_once(sizes):
    if not broken:
      side_channel, = staging.trainer_side().side_channels.values()
      for conn in list(side_channel.listener._connections):  # pylint: disable=protected-access
        conn.shutdown(socket.SHUT_RDWR)
      broken.append(True)
    return take_all(sizes)

  staging.trainer_side().pool.take_all = break_once

  async def main():
    server, handle, engine = await serve(worker)
    router = ADAPTER.installation.orchestrator_side()
    try:
      with pytest.raises((RuntimeError, orchestrator.SideChannelError)) as failed:
        await router.call(engine, handle, "fwd_bwd", payload=big(1, mib=24))
      await router.call(engine, handle, "fwd_bwd", payload=big(2, mib=24))
    finally:
      await close(server, handle, engine)
    return failed.value

  error = asyncio.run(main())
  assert "broke" in str(error).splitlines()[0], error
  assert staging.trainer_side().bulk_calls == {"fwd_bwd": 1}
  (payload, _, _), = worker._trainer.fwd  # pylint: disable=protected-access
  np.testing.assert_array_equal(payload["experts"], big(2, mib=24)["experts"])


def test_the_side_channel_closes_with_the_server_and_on_uninstall(staging):
  worker = new_worker()

  async def main():
    server, handle, engine = await serve(worker)
    listener = staging.trainer_side().side_channels[server].listener
    await close(server, handle, engine)
    return server, listener

  server, listener = asyncio.run(main())
  assert server not in staging.trainer_side().side_channels
  with pytest.raises(OSError):
    socket.create_connection(("127.0.0.1", listener.port), timeout=5).close()
