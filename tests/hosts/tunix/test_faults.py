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
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _serve() -> None:
  """The trainer node: test_grpc's plugin node, plus TrainerWorker.staging_state (test-only)."""
  # pylint: disable=import-outside-toplevel
  import dataclasses

  sys.path.insert(0, HERE)
  import test_grpc
  from tunix.experimental.worker import trainer_worker

  def staging_state(self):
    from tunix_stage_plugin.hosts.tunix import installation
    state = installation.current().staging_of(self)
    return {"keys": state.store.keys(), "stats": dataclasses.asdict(state.store.stats)}

  trainer_worker.TrainerWorker.staging_state = staging_state
  test_grpc.serve("plugin")


def _orchestrate(port: int) -> None:
  """An orchestrator to be killed: trains two steps; prints each stage the trainer staged."""
  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, HERE)
  import test_grpc
  from tunix_stage_plugin.hosts.tunix import program

  stage = program.StageEngine.stage

  async def stage_and_say(self, payload, *, key):
    outcome = await stage(self, payload, key=key)
    print(f"{outcome.status.value} {key}", flush=True)
    return outcome

  program.StageEngine.stage = stage_and_say
  test_grpc.run_program(port, staged=True)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
  _serve()
  sys.exit(0)
if __name__ == "__main__" and sys.argv[1:2] == ["orchestrate"]:
  _orchestrate(int(sys.argv[2]))
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
from tunix_stage_plugin.hosts.tunix import engine as engine_lib
from tunix_stage_plugin.hosts.tunix import sessions

pytestmark = pytest.mark.tunix
ACTOR = datatypes.Role.ACTOR


def _env():
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(
                 p for p in (os.path.dirname(os.path.dirname(os.path.dirname(HERE))),
                             os.environ.get("PYTHONPATH")) if p))
  return env


@pytest.fixture(scope="module")
def node():
  """The node process and its workers' ports; its stderr (the trainer's log) is kept."""
  log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"faults-node-{os.getpid()}.log"),
             "w+", encoding="utf-8")
  proc = subprocess.Popen([sys.executable, __file__, "serve"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=log, text=True, env=_env())
  try:
    line = proc.stdout.readline()
    if not line:
      proc.wait(10)
      log.seek(0)
      pytest.fail(f"trainer node did not start:\n{log.read()[-3000:]}")
    yield types.SimpleNamespace(proc=proc, ports=json.loads(line), log=log)
  finally:
    os.kill(proc.pid, signal.SIGCONT)  # a test that stopped it may have failed before resuming
    proc.stdin.close()
    out = proc.stdout.read()
    code = proc.wait(120)
    log.seek(0)
    text = log.read()
    log.close()
    os.unlink(log.name)
    assert code == 0 and "stopped" in out, text[-3000:]


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
  assert f"reset_staged got no answer within {engine_lib.RESET_TIMEOUT_S:g} s" in caplog.text
  assert took < deadline_s + engine_lib.RESET_TIMEOUT_S + 2.5, took  # margin: a loaded machine
  # The trainer, resumed, answers again and holds what the failed step left (nothing is lost:
  # the next orchestrator's first stage drops it, see the next test); clean it for the next test.
  _call(port, "reset_staged", keys=None)
  assert _staging_state(port)["keys"] == []


def test_a_restarted_orchestrator_stages_from_its_first_step(node, staging):
  """An orchestrator SIGKILLed mid-step with two micro-batches staged on the trainer (device
  bound 2: both slots held); the next one, against the same TrainerWorker, stages from its first
  step with 0 fallbacks and no slot wait, and nothing is left staged."""
  port = node.ports["staged"]
  # The first micro-batch's train holds the step (tunix trains it inline: nothing is staged
  # yet) while the pipeline stages the next two, one per device slot.
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
    if first.poll() is None:
      first.kill()
      first.wait()
    first.stdout.close()
    first.stderr.close()
  held = _staging_state(port)
  assert sorted(held["keys"]) == sorted(staged), held  # the dead orchestrator's, both slots
  _call(port, "set_fwd_bwd_delay", 0.0)  # after the dead orchestrator's train (FIFO lane)

  params, inputs, reports = test_grpc.run_program(port, staged=True)
  after = _staging_state(port)
  assert [r.stage_metrics["stage/fallbacks"] for r in reports] == [0] * test_grpc.STEPS
  assert reports[0].stage_metrics["stage/staged"] >= 1  # staged from its first step
  assert after["stats"]["slot_waits"] == held["stats"]["slot_waits"], (held, after)
  assert after["keys"] == []
  del params, inputs
  # The trainer said so, in one line naming the count and the dead session.
  dead = sessions.session_of(staged[0])
  assert dead is not None and dead != sessions.SESSION
  line = (f"staging on this trainer: dropped 2 staged batch(es) of 1 older session(s) (ts{dead})")
  wait_for(lambda: line in _read(node.log.name), 10, "the trainer's log line")
  assert _read(node.log.name).count("older session(s)") == 1


def _read(path):
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()
