"""tunix's PeftTrainer as a placement (hosts/placements.py): staged through its `_prepare_payload`.

A subclass's own `_prepare_payload` becomes a seam too, the first time it stages (undone with the
installation), so it runs once per micro-batch. Where the trainer has a `PerfTracer`, tunix's
export shows staging's spans on their own timeline and a `peft_train` device span per
computation. Where it logs with a tunix `MetricsLogger`, its backends show `stage/...` beside the
loss, at the loss's step. docs/tunix.md "What it hooks"; docs/observability.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
import types
from typing import Any, Callable, Iterator

import jax
from flax import nnx
from tunix.experimental.common import datatypes
from tunix.perf.experimental import constants as perf_constants
from tunix.perf.experimental import tracer as tracer_lib
from tunix.sft import metrics_logger as metrics_logger_lib

from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.hosts import placements

SEAM = "_prepare_payload"


def model_mesh(model: Any) -> jax.sharding.Mesh:
  for leaf in jax.tree.leaves(nnx.state(model)):
    if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, jax.sharding.NamedSharding):
      return leaf.sharding.mesh
  raise RuntimeError("the trainer's model parameters are not placed on a jax Mesh "
                     "(NamedSharding); staging places a payload on the trainer's mesh")


class PeftPlacement:
  """tunix's PeftTrainer and its subclasses: `_prepare_payload` (`_prepare_inputs`, then sharding
  on the mesh), or a subclass's own override of it."""

  name = "tunix PeftTrainer"
  host = "tunix"
  seam = SEAM

  def __init__(self, peft_cls: type, registry: patching.PatchRegistry) -> None:
    self.peft_cls = peft_cls
    self._registry = registry  # where a subclass's override becomes a seam (undone on uninstall)
    self._lock = threading.Lock()  # stages of several workers may find the same class at once
    self._seams: set[type] = {peft_cls}  # the classes whose own _prepare_payload is a seam

  def find(self, owner: Any) -> tuple[Any, str | None]:
    if not isinstance(owner, self.peft_cls):
      return None, None
    reason = self._seam_for(owner)
    return (None, reason) if reason is not None else (owner, None)

  def _seam_for(self, owner: Any) -> str | None:
    """Makes the `_prepare_payload` that `owner`'s fwd_bwd reaches a seam (None), or says why it
    cannot be one: then staging could not keep its one-preparation promise."""
    if SEAM in vars(owner):
      return (f"{type(owner).__qualname__} sets {SEAM} on the instance; staging hands a "
              f"staged batch through the class's {SEAM}, so it cannot keep its "
              "one-preparation promise here")
    cls = next(c for c in type(owner).__mro__ if SEAM in vars(c))
    with self._lock:
      if cls in self._seams:
        return None
      override = vars(cls)[SEAM]
      if not isinstance(override, types.FunctionType):
        return (f"{cls.__qualname__}.{SEAM} is a {type(override).__name__}, not a method "
                "defined in the class; staging prepares through the trainer's own method once "
                "per micro-batch and cannot keep that promise here")
      placements.set_seam(self._registry, cls, SEAM)
      self._seams.add(cls)
    return None

  def check(self, payload: Any) -> None:
    if isinstance(payload, datatypes.TrainerPayload):
      raise TypeError(f"{type(payload).__name__} is not a JAX pytree; stage what the assembler "
                      "packs for fwd_bwd (e.g. rl_common.TrainExample or a dict of arrays)")

  def place(self, target: Any, payload: Any) -> Any:
    mesh = model_mesh(target.model)
    # `with mesh:` (deprecated in JAX, and it warns) because the host's shard_input reads the
    # legacy thread-local mesh it sets; jax.set_mesh does not set that one.
    with mesh:
      placed = getattr(target, SEAM)(payload)
    # Finish the host-to-device copy here, on the placer thread, never in fwd_bwd.
    return jax.block_until_ready(placed)

  def resolve(self, target: Any, staged: Any) -> tuple[Any, str | None]:
    """At consume time the seam returns the batch prepared at stage time, as it is."""
    del target
    return staged, None

  def computation(self, target: Any, kind: str) -> Any:
    # What PeftTrainer's own train() waits on for its perf span: the loss fwd_bwd just recorded
    # (_record_fwd_bwd), the gradient norm of the update (_record_update).
    if kind == tracks.FWD_BWD:
      return target._buffered_train_metrics.losses[-1]  # pylint: disable=protected-access
    return target._last_update_grad_norm  # pylint: disable=protected-access

  def tracer(self, target: Any) -> tracer_lib.PerfTracer | None:
    """The PerfTracer a PeftTrainer was given, or None (no tracer: tunix's NoopTracer)."""
    tracer = target._perf_tracer_v2  # pylint: disable=protected-access
    return tracer if isinstance(tracer, tracer_lib.PerfTracer) else None

  def metrics_logger(self, target: Any) -> metrics_logger_lib.MetricsLogger | None:
    return logger_of(target)

  def step_sink(self, target: Any, logger: Any) -> "MetricsSink":
    return MetricsSink(logger, target.metrics_prefix)

  def computation_span(self, tracer: tracer_lib.PerfTracer, target: Any
                       ) -> contextlib.AbstractContextManager[Callable[[], None]]:
    return computation(tracer, target, model_mesh(target.model))

  def apply(self) -> Callable[[], None]:
    """Registers this kind (its seam is set at install, hooks.py); returns the call that removes
    it."""
    return placements.register(self)


def logger_of(trainer: Any) -> metrics_logger_lib.MetricsLogger | None:
  """The MetricsLogger a PeftTrainer logs its loss with, or None (a logger of another kind)."""
  logger = trainer.metrics_logger
  return logger if isinstance(logger, metrics_logger_lib.MetricsLogger) else None


@contextlib.contextmanager
def computation(tracer: tracer_lib.PerfTracer, trainer: Any, mesh: Any
                ) -> Iterator[Callable[[], None]]:
  """A `peft_train` span of one fwd_bwd or update call on `trainer` (a PeftTrainer; its step, as
  its own train() tags it): its host span around the block (tunix's `tracer.span`, on no device);
  yields what adds its device span, from the block's start to when it is called, on the devices
  tunix's `tracer.span` would pick. The compute watcher calls it once the computation's output
  is ready (so no thread of tunix's waits for the same output again)."""
  tags = {perf_constants.STEP: trainer._train_steps, perf_constants.ROLE: "actor"}  # pylint: disable=protected-access
  devices = mesh.devices
  if tracer._collect_on_first_device_per_mesh:  # pylint: disable=protected-access
    devices = devices.flat[:1]
  begin = time.perf_counter()

  def ended() -> None:
    timelines = tracer._get_or_create_device_timelines(devices)  # pylint: disable=protected-access
    timelines.span(perf_constants.PEFT_TRAIN, begin, [], tags=tags)  # no waitlist: ended now

  with tracer.span(perf_constants.PEFT_TRAIN, tags=tags):
    yield ended


class TracerSink:
  """A recorder sink: the staging spans on a tunix PerfTracer's timelines.

  tunix's PerfTracer opens host spans only around a block on the thread running it; a staging
  span is known once it ended (a receive ends on a listener's thread or the event loop), so it is
  added with its own times to a host timeline of the tracer's that only this sink writes, one per
  kind of span (`PerfTracer._get_or_create_host_timeline`), as a span started and stopped at
  once. Both clocks are perf_counter, so a span keeps its own times."""

  def __init__(self, tracer: tracer_lib.PerfTracer) -> None:
    self.tracer = tracer

  def record(self, span: recorder_lib.Span) -> None:
    name = figures_lib.SPANS.get(span.track)
    if name is None:
      return
    timeline = self.tracer._get_or_create_host_timeline(f"tunix-stage/{name}")  # pylint: disable=protected-access
    timeline.start_span(name, span.start, tags={perf_constants.NAME: span.name, **dict(span.args)})
    timeline.stop_span(span.end)


class MetricsSink:
  """A step sink: each trainer step's scalars through `logger.log`, under the trainer's metrics
  prefix and in train mode (tags `<prefix>/train/stage/...`), at the step the host's update
  answered: tunix's `train_steps` after it, where PeftTrainer logs the loss of that update's
  micro-batches."""

  def __init__(self, logger: metrics_logger_lib.MetricsLogger, prefix: str) -> None:
    self.logger = logger
    self.prefix = prefix

  def step(self, figures: dict[str, Any]) -> None:
    step = figures["host_step"]
    if step is None:  # the update answered no step: no step of the loss's to sit at
      return
    for name, value in figures_lib.scalars(figures_lib.TRAINER, figures).items():
      self.logger.log(self.prefix, name, value, metrics_logger_lib.Mode.TRAIN, step)
