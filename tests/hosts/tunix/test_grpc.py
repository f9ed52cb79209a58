"""The staged path over real gRPC: tunix's GrpcRemoteExecutionServer, TrainerWorker and PeftTrainer.

Trainer nodes run in subprocesses (each its own 2-device CPU mesh, set before JAX starts) and
serve TrainerWorkers on localhost; this process is the orchestrator and connects over 127.0.0.1.
One node has the plugin installed ("staged" and "timing" workers), the other has not ("plain").
Each worker wraps a PeftTrainer with a tiny flax nnx language model and a non-idempotent
`_prepare_inputs` (it shifts the tokens, so preparing twice trains other numbers), bound to the
mesh the way tunix's trainer node binds it (a small wrapper of our own, which also adds an
optional delay before fwd_bwd so a call can be kept running). Run
`python tests/hosts/tunix/test_grpc.py serve plugin|plain` to start a node by hand.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

TOKENS, SEQ, BATCH = 64, 16, 8  # batch 8 splits over fsdp=2: staged arrays are sharded
STEPS, MICRO = 2, 4


def batch(seed):
  rng = np.random.default_rng(seed)
  mask = np.ones((BATCH, SEQ), np.int32)
  mask[:, -rng.integers(1, 4):] = 0
  return {"tokens": rng.integers(0, TOKENS, (BATCH, SEQ), dtype=np.int32), "mask": mask}


# ---------------------------------------------------------------- the trainer node (subprocess)

def serve(kind: str) -> None:
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  import optax
  import portpicker
  from flax import nnx
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  from tunix.experimental.train import peft_trainer_v2
  from tunix.experimental.worker import remote_execution, trainer_worker

  import tunix_stage_plugin
  from tunix_stage_plugin.core import config as config_lib

  if kind == "plugin":
    assert tunix_stage_plugin.install(
        config_lib.resolve({"mode": "stage", "max_device_batches": 2}, env={})).installed
  mesh = Mesh(np.array(jax.devices()).reshape(2, 1), ("fsdp", "tp"))

  class TinyLM(nnx.Module):

    def __init__(self, rngs):
      self.embed = nnx.Embed(TOKENS, 32, rngs=rngs)
      self.hidden = nnx.Linear(32, 32, rngs=rngs)
      self.out = nnx.Linear(32, TOKENS, rngs=rngs)

    def __call__(self, tokens):
      return self.out(jax.nn.gelu(self.hidden(self.embed(tokens))))

  def loss_fn(model, tokens, mask):
    logp = jax.nn.log_softmax(model(tokens[:, :-1]))
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    weights = mask[:, 1:].astype(jnp.float32)
    return (nll * weights).sum() / jnp.maximum(weights.sum(), 1.0)

  class MeshBound:
    """Enters the worker's mesh around compute calls; passes everything else through."""

    def __init__(self, trainer):
      self._trainer = trainer
      self.delay = 0.0
      self.inputs = []

    def __getattr__(self, name):
      return getattr(self._trainer, name)

    def fwd_bwd(self, payload, **kwargs):
      if self.delay:
        time.sleep(self.delay)
      leaf = payload["tokens"]
      self.inputs.append(str(leaf.sharding.spec) if isinstance(leaf, jax.Array) else "host")
      with mesh:
        self._trainer.fwd_bwd(payload, **kwargs)

    def update(self, **kwargs):
      with mesh:
        return self._trainer.update(**kwargs)

    def close(self):
      with mesh:
        self._trainer.close()

  class NodeWorker(trainer_worker.TrainerWorker):
    """TrainerWorker plus test-only calls (a delay knob, the inputs seen, the parameters)."""

    def set_fwd_bwd_delay(self, seconds):
      self._trainer.delay = seconds

    def inputs_seen(self):
      return list(self._trainer.inputs)

    def parameters(self):
      state = nnx.state(self._trainer.model, nnx.Param)
      return {jax.tree_util.keystr(path): np.asarray(leaf).tobytes()
              for path, leaf in jax.tree_util.tree_leaves_with_path(state)}

  class ShiftingTrainer(peft_trainer_v2.PeftTrainer):
    """Non-idempotent input preparation (a real tunix extension point)."""

    def _prepare_inputs(self, input_data):
      return {**input_data, "tokens": (input_data["tokens"] + 1) % TOKENS}

  def make_trainer():
    with mesh:
      model = TinyLM(nnx.Rngs(0))
      nnx.update(model, jax.tree.map(
          lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec())), nnx.state(model)))
      trainer = ShiftingTrainer(
          model, optax.adamw(1e-2),
          peft_trainer_v2.TrainingConfig(eval_every_n_steps=1000,
                                         gradient_accumulation_steps=MICRO,
                                         data_sharding_axis=("fsdp",), pbar_description=None))
    trainer.with_loss_fn(loss_fn)
    return MeshBound(trainer)

  async def main():
    servers, ports = [], {}
    for name in (("staged", "timing") if kind == "plugin" else ("plain",)):
      worker = NodeWorker(make_trainer, worker_id=name)
      worker.initialize()
      port = portpicker.pick_unused_port()
      server = remote_execution.GrpcRemoteExecutionServer(worker)
      await server.start_serving_async(port)
      servers.append(server)
      ports[name] = port
    print(json.dumps(ports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until stdin closes
    for server in servers:
      await server.stop_serving()
    print("stopped", flush=True)

  asyncio.run(main())


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
  serve(sys.argv[2])
  sys.exit(0)

# ---------------------------------------------------------------- the tests (orchestrator side)

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

from tunix.experimental.common import datatypes  # pylint: disable=wrong-import-position
from tunix.experimental.orchestrator import distributed_rl_engine
from tunix.experimental.orchestrator import rl_program
from tunix.experimental.worker import remote_execution

from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import config as config_lib

pytestmark = pytest.mark.tunix
ACTOR = datatypes.Role.ACTOR


def _start_node(kind):
  env = {k: v for k, v in os.environ.items() if not k.startswith("TUNIX_")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONWARNINGS="ignore")
  proc = subprocess.Popen([sys.executable, __file__, "serve", kind], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  line = proc.stdout.readline()
  if not line:
    proc.wait(10)
    pytest.fail(f"trainer node did not start:\n{proc.stderr.read()[-3000:]}")
  return proc, json.loads(line)


def _stop_node(proc):
  proc.stdin.close()
  out = proc.stdout.read()
  assert proc.wait(120) == 0 and "stopped" in out, proc.stderr.read()[-3000:]


@pytest.fixture(scope="module")
def node():
  """Both nodes (with and without the plugin), started together so their JAX start-ups overlap."""
  procs = [_start_node(kind) for kind in ("plugin", "plain")]
  yield {name: port for _, ports in procs for name, port in ports.items()}
  for proc, _ in procs:
    _stop_node(proc)


def connect(port):
  return remote_execution.ActorHandle.from_address(f"grpc://127.0.0.1:{port}", rpc_timeout_s=120)


def test_stage_completes_while_fwd_bwd_is_still_running(node):
  async def scenario():
    trainer = connect(node["timing"])
    await trainer.asubmit("fwd_bwd", payload=batch(100))  # compile first, outside the timing
    await trainer.asubmit("set_fwd_bwd_delay", 1.5)
    start = time.perf_counter()
    fwd_bwd = asyncio.create_task(trainer.asubmit("fwd_bwd", payload=batch(101)))
    await asyncio.sleep(0.3)
    staged = await trainer.asubmit("stage_batch", payload=batch(102), key="t-1")
    stage_done, running_then = time.perf_counter() - start, not fwd_bwd.done()
    health = await trainer.asubmit("heartbeat")
    await fwd_bwd
    fwd_done = time.perf_counter() - start
    await trainer.asubmit("set_fwd_bwd_delay", 0.0)
    await trainer.asubmit("fwd_bwd", payload=None, stage_key="t-1")
    inputs = await trainer.asubmit("inputs_seen")
    await trainer.close()
    return staged, stage_done, running_then, health, fwd_done, inputs

  staged, stage_done, running_then, health, fwd_done, inputs = asyncio.run(scenario())
  assert staged.metadata["staged"] is True, staged.metadata
  assert running_then and stage_done < 1.2 < fwd_done, (stage_done, fwd_done)
  assert health.state == datatypes.WorkerState.READY
  # Inline calls arrive as host arrays; the staged one arrives placed and sharded over fsdp.
  assert inputs == ["host", "host", "P('fsdp',)"]


class OnePerItem:

  def pack(self, payloads):
    return list(payloads)


def run_program(port, staged):
  """Trains STEPS x MICRO micro-batches through a real StandardRLProgram and engine."""
  reports = []

  async def main():
    handle = connect(port)
    engine = distributed_rl_engine.DistributedRLEngine([], {ACTOR: handle})
    program = rl_program.StandardRLProgram(
        algo=types.SimpleNamespace(group_size=2, mini_batch_size=MICRO // 2,
                                   requires_reference_kl=False),
        assembler=OnePerItem(), max_staleness=1, sync_weights=False,
        on_step_end=lambda step, result: reports.append(program.last_step_result))
    for n in range(STEPS * MICRO):
      item = datatypes.TrajectoryItem(pair_index=n % 2, group_id=f"g{n // 2}", start_step=0,
                                      traj=datatypes.Trajectory(reward=0.0))
      item.payload = batch(n)
      await program.scored_q.put(item)
    await program.train_stage(engine, num_steps=STEPS)
    result = await handle.asubmit("parameters"), await handle.asubmit("inputs_seen")
    await handle.close()
    return result

  manager.uninstall("tunix", quiet=True)
  if staged:
    manager.install(config_lib.resolve({"mode": "stage"}, env={}), quiet=True)
  try:
    params, inputs = asyncio.run(main())
  finally:
    manager.uninstall("tunix", quiet=True)
  return params, inputs, reports


def test_staged_training_is_bit_identical_to_a_trainer_without_the_plugin(node):
  staged_params, staged_inputs, reports = run_program(node["staged"], staged=True)
  inline_params, inline_inputs, inline_reports = run_program(node["plain"], staged=False)
  assert inline_inputs == ["host"] * (STEPS * MICRO)  # the host's own loop, untouched
  assert not hasattr(inline_reports[0], "stage_metrics")
  # The trainer's own count of staged fwd_bwd calls (arrived placed and sharded) is the
  # orchestrator's stage/staged, and most micro-batches were staged.
  staged_count = sum(r.stage_metrics["stage/staged"] for r in reports)
  assert staged_inputs.count("P('fsdp',)") == staged_count >= STEPS * MICRO // 2, staged_inputs
  assert [r.stage_metrics["stage/fallbacks"] for r in reports] == [0] * STEPS
  assert staged_params.keys() == inline_params.keys() and len(staged_params) == 5
  assert staged_params == inline_params  # byte for byte

  async def untrained():  # the timing worker never ran update: its parameters are the initial ones
    handle = connect(node["timing"])
    params = await handle.asubmit("parameters")
    await handle.close()
    return params

  assert all(staged_params[k] != v for k, v in asyncio.run(untrained()).items())  # it trained
