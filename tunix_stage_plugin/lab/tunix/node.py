"""A tunix trainer node for the bench: tunix's GrpcRemoteExecutionServer serving a TrainerWorker
around a PeftTrainer, on a 2-device CPU mesh (or the accelerator's devices).

    python -m tunix_stage_plugin.lab.tunix.node --spec JSON

With `"plugin": false` in the spec the plugin is never installed (tunix byte for byte: the
bench's inline mode); with true it is installed for the trainer role. The model is the embedded bench's decoder LM
(lab/embedded/trainer.py) as a flax nnx module, its loss reading every payload byte; the bench's
own bookkeeping sits around tunix's classes, never inside them:

- a wrapper around the PeftTrainer (as tunix's trainer node binds one to its mesh) records
  which micro-batch trained and swaps a resident micro-batch's id for its placed arrays; each
  fwd_bwd's and update's device span is the trainer's own compute watcher's
  (core.telemetry.recorder.ComputeWatcher: the plugin's on its node, one of its class on the
  plain node), so the calls still answer once XLA has the work queued, as tunix's do;
- a PeftTrainer subclass times `_prepare_payload` (the placement, on whichever lane runs it);
- `bench_*` methods on the TrainerWorker subclass: setup (the initial state again, and the
  payload's size), resident placement, the timeline, the clock, and a run's figures.

Prints one JSON line (port, pid) once it serves, then serves until stdin closes.
docs/bench.md "Hosts".
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import portpicker
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tunix.experimental.train import peft_trainer_v2
from tunix.experimental.worker import remote_execution
from tunix.experimental.worker import trainer_worker
from tunix.sft import sharding_utils

from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.lab.bench import trace as trace_lib
from tunix_stage_plugin.lab import rss
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import trainer as trainer_lib

MB = "mb"  # a micro-batch's (step, index), int32: which one trained, staged or inline alike
RESIDENT = "resident"  # in place of the arrays: the (step, index) of a resident micro-batch
LEARNING_RATE = 1e-3
AXES = ("fsdp",)  # the data sharding axis: the batch split over the mesh's devices


def identity(payload: dict[str, Any]) -> tuple[int, int]:
  step, index = (int(v) for v in np.asarray(payload[RESIDENT if RESIDENT in payload else MB]))
  return step, index


class BenchLM(nnx.Module):
  """The embedded bench's decoder LM (trainer.logits), one nnx.Param per array."""

  def __init__(self, sizes: data_lib.Sizes, seed: int) -> None:
    self.sizes = sizes
    params = trainer_lib.init_params(sizes, seed)
    self.embed, self.pos = nnx.Param(params["embed"]), nnx.Param(params["pos"])
    self.layer_keys = tuple(params["layers"][0])
    for n, layer in enumerate(params["layers"]):
      for key, value in layer.items():
        setattr(self, f"layer{n}_{key}", nnx.Param(value))

  def params(self) -> dict[str, Any]:
    return {"embed": self.embed.value, "pos": self.pos.value,
            "layers": [{k: getattr(self, f"layer{n}_{k}").value for k in self.layer_keys}
                       for n in range(self.sizes.layers)]}


# PeftTrainer calls loss_fn(model, **payload) and nnx's grad wants every argument named: one
# function per payload kind (data.PAYLOADS), each reading every array but the id.
def dense_loss(model: BenchLM, tokens: jax.Array, ballast: jax.Array, mb: jax.Array) -> jax.Array:
  del mb
  return trainer_lib.loss(model.sizes, model.params(), {"tokens": tokens, "ballast": ballast})


def rl_loss(model: BenchLM, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array,
            loss_mask: jax.Array, advantages: jax.Array, old_logprobs: jax.Array,
            ref_logprobs: jax.Array, routed_experts: jax.Array, mb: jax.Array) -> jax.Array:
  del mb
  return trainer_lib.loss(model.sizes, model.params(), {
      "tokens": tokens, "positions": positions, "segment_ids": segment_ids,
      "loss_mask": loss_mask, "advantages": advantages, "old_logprobs": old_logprobs,
      "ref_logprobs": ref_logprobs, "routed_experts": routed_experts})


LOSSES = {data_lib.PAYLOAD_DENSE: dense_loss, data_lib.PAYLOAD_RL: rl_loss}


class _Lane(threading.local):
  inline = False  # this thread runs a fwd_bwd: a placement here is the inline one


class Clocked:
  """The node's timeline, whether the current thread is inside a fwd_bwd, and each
  computation's device span as the trainer's own compute watcher records it (a computation
  starts when it is queued or when the one before it ends, whichever is later; it ends when its
  output is ready), given the bench's name and args (step, index, source) in dispatch order.
  On the plugin's node the watcher is the plugin's (`listen`): the bench waits for nothing."""

  def __init__(self) -> None:
    self.timeline = trace_lib.Kept()
    self.lane = _Lane()
    self._named: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
    own = recorder_lib.Recorder()
    own.add_sink(self)
    self._watcher: recorder_lib.ComputeWatcher | None = recorder_lib.ComputeWatcher(
        own, jax.block_until_ready)
    self._drain: Callable[[float], bool] = self._watcher.drain

  def listen(self, installation: Any) -> None:
    """The plugin's node: its watcher records the computations (and its receive pool's waits,
    which the bench draws and leaves out of the host path), onto this timeline."""
    self._watcher = None
    self._drain = installation.drain
    installation.recorder.add_sink(self)

  def dispatched(self, name: str, queued: float, answered: float, output: Any,
                 args: dict[str, Any]) -> None:
    self._named.append((name, args))
    if self._watcher is not None:
      self._watcher.dispatched(args["kind"], queued, answered, output)

  def drain(self) -> None:
    """Returns once every computation dispatched so far has its span."""
    self._drain(60)

  def reset(self) -> None:
    """An empty timeline for the next run (once every computation so far has its span)."""
    self.drain()
    self.timeline.clear()
    self._named.clear()

  def record(self, span: recorder_lib.Span) -> None:
    """A sink of the watcher's recorder."""
    if span.track == tracks.DEVICE_COMPUTE:
      name, args = self._named.popleft()
      self.timeline.add(span.track, name, span.start, span.end, **{**dict(span.args), **args})
    elif span.track == tracks.TRAINER_POOL_WAIT:
      self.timeline.record(span)


class TimedTrainer(peft_trainer_v2.PeftTrainer):
  """PeftTrainer whose placement (`_prepare_payload`) is timed as the host spends it (tunix does
  not wait for the copy to end: XLA orders it before the computation that reads it), and whose
  bookkeeping seams keep each computation's fresh output (the loss, the gradient norm) for the
  device span watcher."""

  clocked: Clocked
  output: Any = None

  def _record_fwd_bwd(self, train_loss: Any, aux: Any) -> None:
    self.output = train_loss
    super()._record_fwd_bwd(train_loss, aux)

  def _record_update(self, grad_norm: Any) -> int:
    self.output = grad_norm
    return super()._record_update(grad_norm)

  def _prepare_payload(self, payload: Any) -> Any:
    step, index = identity(payload)
    lane = "inline" if self.clocked.lane.inline else "staging"
    start = time.perf_counter()
    placed = super()._prepare_payload(payload)
    nbytes = sum(a.nbytes for k, a in payload.items() if k != MB)
    self.clocked.timeline.add(tracks.TRAINER_H2D, f"s{step}-m{index}", start, time.perf_counter(),
                              step=step, lane=lane, bytes=nbytes)
    return placed


class MeshBound:
  """The PeftTrainer bound to its mesh around compute (as tunix's trainer node binds it), each
  call timed on the device; everything else passes through."""

  def __init__(self, trainer: TimedTrainer, mesh: Mesh, clocked: Clocked) -> None:
    self._trainer = trainer
    self.mesh = mesh
    self._clocked = clocked
    self.resident: dict[tuple[int, int], Any] = {}
    self.trained: list[str] = []
    self.step = 0  # the updates so far: the step a fwd_bwd belongs to

  def __getattr__(self, name: str) -> Any:
    return getattr(self._trainer, name)

  def fwd_bwd(self, payload: Any, **kwargs: Any) -> Any:
    step, index = identity(payload)
    # What reached it: placed ahead (the plugin's stage), resident, or the payload itself.
    source = ("resident" if RESIDENT in payload else
              "staged" if isinstance(payload[MB], jax.Array) else "inline")
    if RESIDENT in payload:
      payload = self.resident[(step, index)]
    self.trained.append(data_lib.mb_id(step, index))
    self._clocked.lane.inline = True
    start = time.perf_counter()
    try:
      with self.mesh:
        result = self._trainer.fwd_bwd(payload, **kwargs)
    finally:
      self._clocked.lane.inline = False
    placed = [s.end for s in self._clocked.timeline.spans(tracks.TRAINER_H2D)
              if s.end >= start and dict(s.args)["lane"] == "inline"]
    self._clocked.dispatched(
        f"fwd_bwd s{step}-m{index}", max([start, *placed]), time.perf_counter(),
        self._trainer.output, {"step": self.step, "kind": tracks.FWD_BWD, "index": index,
                               "source": source})
    return result

  def update(self, **kwargs: Any) -> Any:
    start = time.perf_counter()
    with self.mesh:
      result = self._trainer.update(**kwargs)
    self._clocked.dispatched(f"update s{self.step}", start, time.perf_counter(),
                             self._trainer.output, {"step": self.step, "kind": tracks.UPDATE})
    self.step += 1
    return result

  def close(self) -> None:
    with self.mesh:
      self._trainer.close()


def _copied(tree: Any) -> Any:
  return jax.tree.map(jnp.copy, tree)


class BenchWorker(trainer_worker.TrainerWorker):
  """TrainerWorker plus the bench's own calls (bench_*)."""

  spec: dict[str, Any]
  clocked: Clocked
  initial: tuple[Any, Any] | None = None
  baseline: int | None = None
  listening = False  # the plugin's watcher and pool waits reach the bench's timeline

  def bench_info(self) -> dict[str, Any]:
    return {"platform": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "pid": os.getpid(), "plugin": hasattr(trainer_worker.TrainerWorker, "stage_batch")}

  def bench_clock(self) -> float:
    return time.perf_counter()

  def bench_setup(self, sizes: dict[str, Any] | None = None,
                  max_host_batches: int | str | None = None) -> int | None:
    """The initial parameters, optimizer state and accumulator again (compiled functions kept),
    an empty timeline and resident set, the staging store's peaks and this process's peak RSS
    from now; `sizes` (data.Sizes fields), when given, the micro-batches' from now (the model
    does not depend on the payload's size, so one node serves runs of several);
    `max_host_batches`, when given, the plugin's host bound from now (auto: sized, from its
    start, as a job's first run)."""
    if sizes is not None:
      self.spec = {**self.spec, "sizes": sizes}
    trainer = self._trainer
    if self.initial is None:
      self.initial = (_copied(nnx.state(trainer.model)), _copied(nnx.state(trainer.optimizer)))
    else:
      nnx.update(trainer.model, _copied(self.initial[0]))
      nnx.update(trainer.optimizer, _copied(self.initial[1]))
    trainer.grad_accumulator.reset()
    trainer.resident.clear()
    trainer.trained.clear()
    trainer.step = 0
    store = _store(self)
    if store is not None and not self.listening:  # the plugin's watcher: the bench's spans
      self.clocked.listen(_installation())
      self.listening = True
    self.clocked.reset()  # the last run's computations recorded (by the plugin's watcher too)
    if store is not None:
      if max_host_batches is not None:
        _host_bound(max_host_batches)
      store.stats.peak = store.stats.peak_host = 0
      _installation().telemetry.restart()  # its step figures start again with this run
    self.baseline = rss.reset_peak()
    return self.baseline

  def bench_records(self) -> list[dict[str, Any]]:
    """The plugin's own per-step records of this node's trainer since bench_setup (the job-side
    figures the bench checks against its own; [] without the plugin)."""
    if not self.spec["plugin"]:
      return []
    installation = _installation()
    installation.drain(60)
    return list(installation.telemetry.history["trainer"])

  def bench_place_resident(self, ids: list[tuple[int, int]]) -> int:
    """Builds these micro-batches here and places them; an array shared by several (a position's
    bulk array) is placed once."""
    trainer = self._trainer
    sizes = data_lib.Sizes(**self.spec["sizes"])
    make = data_lib.BatchMaker(sizes, self.spec["seed"])
    placed: dict[int, tuple[np.ndarray, Any]] = {}  # id(array): (array, its placement)

    def place(array: np.ndarray) -> Any:  # as PeftTrainer places a payload (shard_input)
      return jax.block_until_ready(sharding_utils.shard_input({"x": array}, AXES)["x"])

    with trainer.mesh:
      for step, index in ids:
        arrays = make(step, index).arrays
        for array in arrays.values():
          if id(array) not in placed:
            placed[id(array)] = (array, place(array))
        trainer.resident[(step, index)] = {**{k: placed[id(a)][1] for k, a in arrays.items()},
                                           MB: place(np.array([step, index], np.int32))}
    return len(trainer.resident)

  def bench_timeline(self) -> list[recorder_lib.Span]:
    self.clocked.drain()
    return self.clocked.timeline.spans()

  def bench_finish(self) -> dict[str, Any]:
    self.clocked.drain()
    trainer = self._trainer
    store = _store(self)
    plugin = store is not None  # (an empty store is falsy: it has a length)
    return {
        "param_digest": trainer_lib.params_digest(nnx.state(trainer.model, nnx.Param)),
        "trained_order": list(trainer.trained),
        "rss": {"baseline": self.baseline, "peak": rss.peak()},
        "store": {"peak": store.stats.peak if plugin else 0,
                  "peak_host": store.stats.peak_host if plugin else 0},
        "max_device_batches": store.max_device_batches if plugin else 0,
        "device_memory": {"baseline": None, "sampled_peak": None, "allocator_peak": None},
    }


def _installation() -> Any:
  """The plugin's installation on this node (its receive pool, each worker's staging)."""
  # pylint: disable-next=import-outside-toplevel
  from tunix_stage_plugin.hosts.tunix import adapter
  return adapter.ADAPTER.installation


def _host_bound(value: int | str) -> None:
  """The plugin's host bound from now: a fixed one, or auto sized from its start."""
  # pylint: disable-next=import-outside-toplevel
  import tunix_stage_plugin
  installation = _installation()
  config = installation.live.config
  host_bound = installation.trainer_side().host_bound
  if host_bound is not None:  # a new run sizes from the start, as a job's first
    host_bound.restart(config.max_device_batches)
  tunix_stage_plugin.install(dataclasses.replace(config, max_host_batches=value), quiet=True)


def _store(worker: BenchWorker) -> Any:
  """The plugin's staging store for this worker (None on a node without the plugin)."""
  if not worker.spec["plugin"]:
    return None
  return _installation().trainer_side().staging_of(worker).store


def make_trainer(spec: dict[str, Any], mesh: Mesh, clocked: Clocked) -> MeshBound:
  sizes = data_lib.Sizes(**spec["sizes"])
  replicated = NamedSharding(mesh, PartitionSpec())
  with mesh:
    model = BenchLM(sizes, spec["seed"])
    nnx.update(model, jax.tree.map(lambda x: jax.device_put(x, replicated), nnx.state(model)))
    trainer = TimedTrainer(model, optax.adamw(LEARNING_RATE), peft_trainer_v2.TrainingConfig(
        eval_every_n_steps=10**9, gradient_accumulation_steps=spec["microbatches"],
        data_sharding_axis=AXES, pbar_description=None))
  trainer.clocked = clocked
  trainer.with_loss_fn(LOSSES[sizes.payload])
  return MeshBound(trainer, mesh, clocked)


def serve(spec: dict[str, Any]) -> None:
  if spec["plugin"]:
    # pylint: disable-next=import-outside-toplevel
    import tunix_stage_plugin
    # pylint: disable-next=import-outside-toplevel
    from tunix_stage_plugin.core import config as config_lib
    activation = tunix_stage_plugin.install(config_lib.resolve(
        {"mode": "stage", "max_device_batches": spec["max_device_batches"],
         "max_host_batches": spec["max_host_batches"], "codec": spec["codec"]}, env={}),
        quiet=True)
    if not activation.installed:
      raise SystemExit(f"tunix-stage bench node: the plugin did not install: {activation.line}")
  devices = np.array(jax.devices())
  mesh = Mesh(devices.reshape(len(devices), 1), ("fsdp", "tp"))
  clocked = Clocked()
  worker = BenchWorker(lambda: make_trainer(spec, mesh, clocked), worker_id="bench")
  worker.spec, worker.clocked = spec, clocked
  worker.initialize()

  async def main() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C reaches the whole process group
      loop.add_signal_handler(signum, stop.set)
    port = portpicker.pick_unused_port()
    server = remote_execution.GrpcRemoteExecutionServer(worker)
    await server.start_serving_async(port)
    print(json.dumps({"port": port, "pid": os.getpid()}), flush=True)
    # Until stdin closes (the bench is done, or gone) or a signal comes; the reader is a daemon
    # thread, so a signal need not wait for stdin.
    threading.Thread(target=_set_when_closed, args=(loop, stop), daemon=True).start()
    await stop.wait()
    await server.stop_serving()

  asyncio.run(main())


def _set_when_closed(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
  sys.stdin.read()
  with contextlib.suppress(RuntimeError):  # the loop already closed (a signal stopped it)
    loop.call_soon_threadsafe(stop.set)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
  parser.add_argument("--spec", required=True,
                      help="JSON: plugin (bool), sizes (data.Sizes fields), seed, microbatches, "
                      "max_device_batches, max_host_batches, codec")
  args = parser.parse_args(argv)
  serve(json.loads(args.spec))


if __name__ == "__main__":
  main()
