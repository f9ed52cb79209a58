"""tunix's host under a frozen trainer and a killed orchestrator, with real processes.

A trainer node in a subprocess (test_grpc.py's node with the plugin: tunix's
GrpcRemoteExecutionServer serving TrainerWorkers over 127.0.0.1, each a PeftTrainer with a tiny
flax model on a 2-device CPU mesh, device bound 2); the node adds one test-only method to
TrainerWorker, `staging_state`, that reads the worker's staged keys and store counters. The
orchestrators are this process (a real StandardRLProgram and DistributedRLEngine) and, for the
one that is killed, a subprocess (`python test_faults.py orchestrate PORT`). Every wait is a
bounded poll on /proc, a pipe or an exit status.

- A trainer SIGSTOPped mid-job fails the job within tunix's own call deadline plus the reset's
  short deadline (`engine.RESET_TIMEOUT_S`), not another whole call deadline.
- An orchestrator SIGKILLed mid-step with micro-batches staged: the next orchestrator against
  the same TrainerWorker stages from its first step, 0 fallbacks and no slot wait (docs/tunix.md,
  "One orchestrator per trainer").
- Faults 64 MiB into a 256 MiB stage over the bulk side channel ('mid-transfer' is an event: the
  orchestrator's BulkSender reaching that byte, seen by a pacer of the test's that paces nothing):
  a trainer SIGKILLed (a node of its own) fails the call at once with one clear error, this
  process keeping no thread and no fd of it; a trainer SIGSTOPped fails the call, send included, at
  tunix's call deadline, and, resumed, drops the transfer (receive buffer back in the pool, no
  receive thread, nothing staged, nothing run) and serves the next stage from the same buffer; an
  orchestrator SIGKILLed (a subprocess) leaves the trainer the same, within the trainer's bound
  on a transfer, and the next orchestrator's stage works. The node's `staging_state` also
  reports its receive-buffer pool (after a collection), side-channel calls and receive threads.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _serve(workers: list[str]) -> None:
  """The trainer node: test_grpc's plugin node (only `workers`, when named), plus
  TrainerWorker.staging_state (test-only)."""
  # pylint: disable=import-outside-toplevel
  import dataclasses
  import gc
  import threading

  sys.path.insert(0, HERE)
  import test_grpc
  from tunix.experimental.worker import trainer_worker

  def staging_state(self):
    from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER
    inst = ADAPTER.installation
    state = inst.trainer_side().staging_of(self)
    # JAX drops its alias of a dropped batch's buffer in a gc callback (the pool's take collects
    # the same way before making a buffer): what is in use is what a collection leaves.
    gc.collect()
    pool = inst.trainer_side().pool
    return {"keys": state.store.keys(), "stats": dataclasses.asdict(state.store.stats),
            "pool": {"made": pool.made, "reused": pool.reused, "held": pool.held_bytes(),
                     "idle": pool.idle_bytes()},
            "bulk_calls": dict(inst.trainer_side().bulk_calls),
            "recv_threads": sum(t.name == "trainer-bulk-recv" for t in threading.enumerate())}

  trainer_worker.TrainerWorker.staging_state = staging_state
  if workers:
    test_grpc.PLUGIN_WORKERS = tuple(workers)
  test_grpc.serve("plugin")


def _orchestrate(port: int) -> None:
  """An orchestrator to be killed: trains two steps; prints each stage the trainer staged."""
  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, HERE)
  import test_grpc
  from tunix_stage_plugin.hosts.tunix import orchestrator

  stage = orchestrator.StagingCalls.stage

  async def stage_and_say(self, payload, *, key):
    outcome = await stage(self, payload, key=key)
    print(f"{outcome.status.value} {key}", flush=True)
    return outcome

  orchestrator.StagingCalls.stage = stage_and_say
  test_grpc.run_program(port, staged=True)


def _send_and_hang(port: int) -> None:
  """An orchestrator to be killed mid-transfer: stages one BIG micro-batch over the side channel
  and, once MID_BYTES of it are sent, says so and sends no more (its chunks stop there)."""
  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, HERE)
  import test_grpc
  from tunix.experimental.orchestrator import distributed_rl_engine as engine_mod
  from tunix_stage_plugin.activation import manager as manager_mod
  from tunix_stage_plugin.core import config
  from tunix_stage_plugin.transport import sender as sender_lib

  async def hang(sent):
    print(f"mid-transfer {sent}", flush=True)
    await asyncio.Event().wait()

  sender_lib.frame_chunks = At(MID_BYTES, hang)
  manager_mod.install(config.resolve({"mode": "stage"}, env={}), quiet=True)

  async def main():
    handle = test_grpc.connect(port)
    engine = engine_mod.DistributedRLEngine([], {test_grpc.ACTOR: handle})
    await engine.stage_train_batch(big_batch(0), key="dead-0")

  asyncio.run(main())


# A BIG micro-batch: test_grpc's 256 MiB of routed-expert ids; a fault lands MID_BYTES into it.
MID_BYTES = 64 << 20


def big_batch(seed):
  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, HERE)
  import test_grpc
  return test_grpc.batch(seed, test_grpc.BIG_LAYERS, test_grpc.BIG_TOP_K, test_grpc.BIG_ROUTED)


class At:
  """How the orchestrator's BulkSender hands a frame's bytes to the socket (its chunks,
  transport.sender.Chunks, in place of sender.frame_chunks): the same chunks, but before the first
  chunk past `nbytes` handed to the kernel it awaits `act(sent)` once. That is the tests' event
  'mid-transfer'."""

  def __init__(self, nbytes, act):
    self.nbytes, self.act, self.sent, self.fired = nbytes, act, 0, None

  async def __call__(self, buffers):
    from tunix_stage_plugin.transport import wire  # pylint: disable=import-outside-toplevel
    for chunk in wire.iter_chunks(buffers):
      if self.fired is None and self.sent >= self.nbytes:
        self.fired = self.sent
        await self.act(self.sent)
      self.sent += chunk.nbytes
      yield chunk


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
  _serve(sys.argv[2:])
  sys.exit(0)
if __name__ == "__main__" and sys.argv[1:2] == ["orchestrate"]:
  _orchestrate(int(sys.argv[2]))
  sys.exit(0)
if __name__ == "__main__" and sys.argv[1:2] == ["send-and-hang"]:
  _send_and_hang(int(sys.argv[2]))
  sys.exit(0)

# ---------------------------------------------------------------- the tests (orchestrator side)

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

# pylint: disable=wrong-import-position
import grpc
from tunix.experimental.common import datatypes
from tunix.experimental.orchestrator import distributed_rl_engine
from tunix.experimental.orchestrator import rl_program
from tunix.experimental.worker import remote_execution

from tests.embedded.support import process_state, wait_for
from tests.hosts.tunix import test_grpc
from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.hosts.tunix import orchestrator
from tunix_stage_plugin.hosts.tunix.adapter import ADAPTER
from tunix_stage_plugin.transport import wire
from tunix_stage_plugin.transport import sender as sender_lib

pytestmark = pytest.mark.tunix
ACTOR = datatypes.Role.ACTOR


def _env():
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(
                 p for p in (os.path.dirname(os.path.dirname(os.path.dirname(HERE))),
                             os.environ.get("PYTHONPATH")) if p))
  return env


def _start_node(*workers):
  """A node process (every plugin worker of test_grpc's node, or only `workers`) and its workers'
  ports; its stderr (the trainer's log) is kept."""
  log = tempfile.NamedTemporaryFile("w+", prefix="faults-node-", suffix=".log", delete=False,
                                    encoding="utf-8")
  proc = subprocess.Popen([sys.executable, __file__, "serve", *workers], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=log, text=True, env=_env())
  line = proc.stdout.readline()
  if not line:
    proc.wait(10)
    log.seek(0)
    text = log.read()
    log.close()
    os.unlink(log.name)
    pytest.fail(f"trainer node did not start:\n{text[-3000:]}")
  return types.SimpleNamespace(proc=proc, ports=json.loads(line), log=log)


def _stop_node(node, code=0):
  """Stops the node (resumed first: a test that stopped it may have failed before resuming);
  checks it exits `code` (0 and 'stopped' for a clean stop; a killed one is only reaped)."""
  if node.proc.poll() is None:
    os.kill(node.proc.pid, signal.SIGCONT)
  node.proc.stdin.close()
  out = node.proc.stdout.read()
  exited = node.proc.wait(120)
  node.log.seek(0)
  text = node.log.read()
  node.log.close()
  os.unlink(node.log.name)
  assert exited == code and (code != 0 or "stopped" in out), text[-3000:]


@pytest.fixture(scope="module")
def node():
  started = _start_node()
  try:
    yield started
  finally:
    _stop_node(started)


def _call(port, method, *args, **kwargs):
  async def go():
    handle = test_grpc.connect(port)
    try:
      return await handle.asubmit(method, *args, **kwargs)
    finally:
      await handle.close()
  return asyncio.run(go())


def _staging_state(port):
  return _call(port, "staging_state")


def _program(handle, steps, on_step_end=None):
  engine = distributed_rl_engine.DistributedRLEngine([], {ACTOR: handle})
  program = rl_program.StandardRLProgram(
      algo=types.SimpleNamespace(group_size=2, mini_batch_size=test_grpc.MICRO // 2,
                                 requires_reference_kl=False),
      assembler=test_grpc.OnePerItem(), max_staleness=1, sync_weights=False,
      on_step_end=on_step_end)
  return engine, program


async def _fill(program, steps, seed=0):
  for n in range(steps * test_grpc.MICRO):
    item = datatypes.TrajectoryItem(pair_index=n % 2, group_id=f"g{n // 2}", start_step=0,
                                    traj=datatypes.Trajectory(reward=0.0))
    item.payload = test_grpc.batch(seed + n)
    await program.scored_q.put(item)


@pytest.fixture
def staging():
  manager.uninstall("tunix", quiet=True)
  manager.install(config_lib.resolve({"mode": "stage"}, env={}), quiet=True)
  yield
  manager.uninstall("tunix", quiet=True)


@pytest.mark.loop_way
def test_a_sigstopped_trainer_fails_the_job_within_the_call_deadline_plus_a_short_reset(
    node, staging, caplog):
  """The trainer freezes after step 0. Step 1's calls wait tunix's call deadline (the handle's
  rpc_timeout_s) and fail; the cleanup reset then gets RESET_TIMEOUT_S, not another deadline
  (before: the reset waited its own whole deadline, ~20 s on tunix's 60 s default)."""
  caplog.set_level(logging.WARNING, logger="tunix_stage_plugin")
  port, pid = node.ports["timing"], node.proc.pid
  deadline_s = 8.0  # tunix's rpc_timeout_s for this run (60 s by default)
  stopped = []

  def freeze(step, result):  # step: the program's policy version, 1 after step 0
    if not stopped:
      os.kill(pid, signal.SIGSTOP)
      wait_for(lambda: process_state(pid) == "T", 10, "the trainer node stopping")
      stopped.append(time.monotonic())

  async def main():
    handle = remote_execution.ActorHandle.from_address(f"grpc://127.0.0.1:{port}",
                                                       rpc_timeout_s=deadline_s)
    engine, program = _program(handle, 2, freeze)
    await _fill(program, 2)
    try:
      await program.train_stage(engine, num_steps=2)
    finally:
      failed.append(time.monotonic())
      os.kill(pid, signal.SIGCONT)
      await handle.close()

  failed = []
  with pytest.raises(Exception) as raised:
    asyncio.run(main())
  assert stopped and failed, raised.value
  took = failed[0] - stopped[0]
  # tunix's own error for the frozen call (its deadline; with a long one, its keepalive's).
  assert isinstance(raised.value, grpc.aio.AioRpcError), raised.value
  assert raised.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                 grpc.StatusCode.UNAVAILABLE), raised.value
  # The cleanup could not reach the frozen trainer: its reset is kept (retried before a next
  # step), and it cost RESET_TIMEOUT_S.
  assert "could not reset staged keys" in caplog.text, caplog.text
  assert f"reset_staged got no answer within {orchestrator.RESET_TIMEOUT_S:g} s" in caplog.text
  assert took < deadline_s + orchestrator.RESET_TIMEOUT_S + 2.5, took  # margin: a loaded machine
  # The trainer, resumed, answers again and holds what the failed step left (nothing is lost:
  # the next orchestrator's first stage drops it, see the next test); clean it for the next test.
  _call(port, "reset_staged", keys=None)
  assert _staging_state(port)["keys"] == []


def test_a_restarted_orchestrator_stages_from_its_first_step(node, staging):
  """An orchestrator SIGKILLed mid-step with two micro-batches staged on the trainer (device
  bound 2: both slots held); the next one, against the same TrainerWorker, stages from its first
  step with 0 fallbacks (its first stage drops the dead one's two), and nothing is left staged."""
  port = node.ports["staged"]
  # The first micro-batch's train holds the step (tunix trains it inline: nothing is staged
  # yet) while the pipeline stages the next two, one per device slot; at most 8 s, released once
  # the orchestrator is dead.
  _call(port, "set_fwd_bwd_delay", 8.0)
  first = subprocess.Popen([sys.executable, __file__, "orchestrate", str(port)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
  try:
    staged = []
    while len(staged) < 2:  # bounded by the pipe: the orchestrator prints each stage, or ends
      line = first.stdout.readline()
      if not line:
        raise AssertionError(f"the first orchestrator ended: {first.stderr.read()[-3000:]}")
      if line.startswith("staged "):
        staged.append(line.split()[1])
    first.kill()  # SIGKILL, mid-step: no cleanup runs
    assert first.wait(30) == -signal.SIGKILL
  finally:
    _reap(first)
  _call(port, "release_delayed_fwd_bwd")  # the dead orchestrator's train ends now (it is done)
  held = _staging_state(port)
  assert sorted(held["keys"]) == sorted(staged), held  # the dead orchestrator's, both slots
  _call(port, "set_fwd_bwd_delay", 0.0)  # after the dead orchestrator's train (FIFO lane)

  params, inputs, reports = test_grpc.run_program(port, staged=True)
  after = _staging_state(port)
  assert [r.stage_metrics["stage/fallbacks"] for r in reports] == [0] * test_grpc.STEPS
  assert reports[0].stage_metrics["stage/staged"] >= 1  # staged from its first step
  # The first stage dropped the dead one's two batches, so no placement waited them out (that
  # would be 30 s and an unplaced fallback). A slot wait may still be counted: a stage racing the
  # train call whose take frees its slot waits that moment, by design (docs/design.md).
  assert after["stats"]["dropped"] - held["stats"]["dropped"] == 2, (held, after)
  assert after["stats"]["unplaced"] == held["stats"]["unplaced"], (held, after)
  assert after["keys"] == []
  del params, inputs
  # The trainer said so, in one line naming the count and the dead session.
  dead = contract.session_of(staged[0])
  assert dead is not None and dead != contract.SESSION
  line = (f"staging on this trainer: dropped 2 staged batch(es) of 1 older session(s) (ts{dead})")
  wait_for(lambda: line in _read(node.log.name), 10, "the trainer's log line")
  assert _read(node.log.name).count("older session(s)") == 1


def _reap(proc):
  """Kills `proc` if it still runs and closes its pipes."""
  if proc.poll() is None:
    proc.kill()
    proc.wait()
  proc.stdout.close()
  proc.stderr.close()


def _read(path):
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


# ---------------------------------------------------------------- faults mid-transfer, at size


def _open_fds():
  return len(os.listdir("/proc/self/fd"))


def _in_use(state):
  """Bytes of the trainer's receive buffers some transfer or array still holds."""
  return state["pool"]["held"] - state["pool"]["idle"]


# The trainer's own bound on a transfer whose bytes stop coming: its listener's stall bound, plus
# the pairing wait for one whose frame never began (transport.wire.BulkLimits).
BIG_WAIT_BOUND_S = wire.BulkLimits().stall_s + wire.BulkLimits().pair_wait_s


def _await_dropped(port):
  """The trainer's staging state once no transfer holds a receive buffer or a receive thread
  (polled within the trainer's own bound on a transfer); its seconds to get there, too."""
  start = time.monotonic()

  def dropped():
    state = _staging_state(port)
    return state if _in_use(state) == 0 and state["recv_threads"] == 0 else None

  state = wait_for(dropped, BIG_WAIT_BOUND_S, "the trainer dropping the transfer")
  state["took"] = time.monotonic() - start
  return state


async def _stage_big(port, seed, key, deadline_s=120.0):
  """Stages one BIG micro-batch on `port`'s worker from a fresh handle and engine (closed after),
  then drops it again; the stage's outcome."""
  handle = remote_execution.ActorHandle.from_address(f"grpc://127.0.0.1:{port}",
                                                     rpc_timeout_s=deadline_s)
  engine = distributed_rl_engine.DistributedRLEngine([], {ACTOR: handle})
  try:
    outcome = await engine.stage_train_batch(big_batch(seed), key=key)
    await engine.reset_staged_batches([key])
    return outcome
  finally:
    await ADAPTER.installation.orchestrator_side().close_connections()
    await handle.close()


def _dropped_then_serves(port, before, seed, key):
  """Waits for the trainer to drop a faulted transfer (nothing of it staged or run), then stages
  the next BIG micro-batch over the side channel from the same buffer; the dropped state."""
  dropped = _await_dropped(port)
  assert dropped["keys"] == [], dropped
  assert dropped["bulk_calls"] == before["bulk_calls"], dropped  # nothing of it was run
  assert asyncio.run(_stage_big(port, seed, key)).staged
  after = _staging_state(port)
  assert after["bulk_calls"].get("stage_batch", 0) == before["bulk_calls"].get("stage_batch",
                                                                               0) + 1
  assert after["pool"]["made"] == dropped["pool"]["made"], (dropped, after)  # its buffer reused
  assert after["keys"] == []
  return dropped


def _faulted_stage(port, deadline_s, act, monkeypatch):
  """Stages a BIG micro-batch whose sender awaits `act(sent)` once MID_BYTES are sent; the
  error the stage ended with (its type, gRPC code or None, and message) and the seconds from the
  fault to it."""
  pacer = At(MID_BYTES, act)
  monkeypatch.setattr(sender_lib, "frame_chunks", pacer)
  faulted = []

  async def stage():
    async def act_then_time(sent):
      await act(sent)
      faulted.append(time.monotonic())
    pacer.act = act_then_time
    try:
      await _stage_big(port, 1, "faulted", deadline_s)
    except Exception as e:  # pylint: disable=broad-except
      # What the error says, not the error (its traceback would keep the call's channel open).
      code = e.code() if isinstance(e, grpc.aio.AioRpcError) else None
      return (type(e), code, str(e)), time.monotonic()
    raise AssertionError("the stage did not fail")

  error, ended = asyncio.run(stage())
  monkeypatch.undo()
  assert faulted and MID_BYTES <= pacer.fired < 2 * MID_BYTES, pacer.fired  # mid-transfer
  return error, ended - faulted[0]


def test_a_trainer_killed_mid_transfer_fails_the_call_at_once_leaving_nothing(staging,
                                                                              monkeypatch):
  """A trainer node (its own, with one worker) SIGKILLed 64 MiB into a 256 MiB stage over the
  side channel: the call ends with one clear error (the broken side channel, or tunix's
  UNAVAILABLE for the call), long before tunix's call deadline, and this process keeps no
  thread and no fd of it, and leaves no socket for the garbage collector to close."""
  lone = _start_node("bulk")
  try:
    port, deadline_s = lone.ports["bulk"], 30.0
    assert asyncio.run(_stage_big(port, 0, "warm")).staged  # grpcio's process-wide threads
    gc.collect()  # the warm-up's cycles (a call's error keeps its channel, and grpcio's poller)
    fds, threads = _open_fds(), set(threading.enumerate())

    async def kill(sent):
      del sent
      lone.proc.kill()
      lone.proc.wait(10)  # reaped: the trainer is gone

    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always", ResourceWarning)  # a socket left for gc to close says so
      error, took = _faulted_stage(port, deadline_s, kill, monkeypatch)
      gc.collect()  # the faulted call's cycles, as the warm-up's
    assert not [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    kind, code, message = error
    if issubclass(kind, grpc.aio.AioRpcError):
      assert code == grpc.StatusCode.UNAVAILABLE, error
    else:
      assert kind is orchestrator.SideChannelError, error
      assert "broke while sending stage_batch's 256.1 MiB" in message, error
    assert took < deadline_s / 2, took  # generous: it is about the kernel noticing, not a deadline
    # grpcio closes the dead trainer's connection attempts on threads of its own: a bounded poll.
    wait_for(lambda: _open_fds() == fds, 10, f"back to the {fds} fds this process had")
    # Its aio poller thread ends once the faulted loop's last channel is gone: a bounded poll too.
    wait_for(lambda: set(threading.enumerate()) == threads, 10,
             f"back to the threads {sorted(t.name for t in threads)} this process had")
    print(f"\ntrainer SIGKILLed mid-transfer: the call failed {took:.2f} s after ({error[2]:.60})")
  finally:
    _stop_node(lone, code=-signal.SIGKILL if lone.proc.poll() is not None else 0)


def test_a_trainer_stopped_mid_transfer_fails_the_call_at_its_deadline_and_serves_on(
    node, staging, monkeypatch):
  """The trainer node SIGSTOPped 64 MiB into a 256 MiB stage over the side channel: the call
  (and its send, blocked on a full socket) ends at tunix's call deadline with tunix's
  DEADLINE_EXCEEDED. Resumed, the trainer drops the transfer (its buffers back in the pool,
  nothing staged, no receive thread left) and serves the next 256 MiB stage over the side
  channel from the same buffer."""
  port, pid, deadline_s = node.ports["bulk_big"], node.proc.pid, 8.0
  before = _staging_state(port)

  async def stop(sent):
    del sent
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: process_state(pid) == "T", 10, "the trainer node stopping")

  try:
    error, took = _faulted_stage(port, deadline_s, stop, monkeypatch)
  finally:
    os.kill(pid, signal.SIGCONT)
  assert issubclass(error[0], grpc.aio.AioRpcError) and (
      error[1] == grpc.StatusCode.DEADLINE_EXCEEDED), error
  assert took < deadline_s + 2.5, took  # margin: a loaded machine
  dropped = _dropped_then_serves(port, before, 2, "after-stop")
  print(f"\ntrainer SIGSTOPped mid-transfer: the call failed {took:.2f} s after (deadline "
        f"{deadline_s:g} s); resumed, the transfer was dropped {dropped['took']:.2f} s later")


def test_an_orchestrator_killed_mid_transfer_leaves_the_trainer_clean_for_the_next(node,
                                                                                  staging):
  """An orchestrator (a subprocess) SIGKILLed 64 MiB into a 256 MiB stage over the side channel,
  its bytes mid-receive on the trainer (a 256 MiB receive buffer taken): the trainer drops the
  transfer within its own bound (the connection's end fails it; the header's call ends with the
  dead orchestrator's channel), its buffer back in the pool, nothing staged, no receive thread
  left; the next orchestrator's 256 MiB stage over the side channel works, from the same buffer."""
  port = node.ports["bulk_big"]
  before = _staging_state(port)
  assert _in_use(before) == 0, before
  dead = subprocess.Popen([sys.executable, __file__, "send-and-hang", str(port)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
  try:
    line = dead.stdout.readline()  # bounded by the pipe: it says so, or it ends
    assert line.startswith("mid-transfer "), dead.stderr.read()[-3000:] if not line else line
    assert MID_BYTES <= int(line.split()[1]) < 2 * MID_BYTES, line
    receiving = wait_for(lambda: (lambda s: s if _in_use(s) >= 256 << 20 else None)(
        _staging_state(port)), 30, "the trainer receiving into a 256 MiB buffer")
    assert receiving["recv_threads"] >= 1
    dead.kill()  # SIGKILL, mid-transfer: no cleanup runs
    assert dead.wait(30) == -signal.SIGKILL
  finally:
    _reap(dead)
  dropped = _dropped_then_serves(port, before, 3, "after-kill")
  print(f"\norchestrator SIGKILLed mid-transfer: the trainer dropped the transfer within "
        f"{dropped['took']:.2f} s (its bound {BIG_WAIT_BOUND_S:g} s)")
