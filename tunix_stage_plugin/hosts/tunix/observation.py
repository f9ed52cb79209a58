"""Every fwd_bwd and update the worker runs, observed for the job's telemetry without changing what
it does or answers: its inline preparation timed through the placement's seam, its computation's
output handed to the installation's watcher (which records the device time off the compute lane),
and, where the trainer has a tunix PerfTracer, a `peft_train` span around it (tracing.py); where
it has a metrics logger, each step's figures go there too (its placement's step sink:
metrics.py, hosts/maxtext/metrics.py).
docs/observability.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.hosts import placements
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import peft

log = logging.getLogger("tunix_stage_plugin")


def nbytes(payload: Any) -> int:
  """The array bytes of a payload (a pytree)."""
  return sum(leaf.nbytes for leaf in jax.tree.leaves(payload)
             if isinstance(leaf, (np.ndarray, jax.Array)))


# What a trainer may not hold (a line's words): what the telemetry reads, and what is then lost.
OUTPUT = ("computation output to watch", "its steps are not measured")
TRACER = ("PerfTracer to read", "staging's spans are not on its timelines")
LOGGER = ("metrics logger to read", "staging's figures are not logged there")


def _unless_broken(inst: installation_lib.Installation, target: Any, read: Any,
                   lacking: tuple[str, str]) -> Any:
  """`read()` (what the telemetry reads of the trainer), or None, said once per trainer type
  and `lacking` (OUTPUT, TRACER, LOGGER) where this trainer does not hold it: it trains on."""
  try:
    return read()
  except Exception as e:  # pylint: disable=broad-except  (telemetry never fails a training call)
    if inst.first_time(f"unobserved:{lacking[0]}:{type(target).__qualname__}"):
      log.warning("tunix-stage: telemetry: %s holds no %s (%s: %s); %s",
                  type(target).__qualname__, lacking[0], type(e).__name__, e, lacking[1])
    return None


def observed(inst: installation_lib.Installation, state: installation_lib.WorkerStaging,
             kind: str, call: Callable[[], Any], payload_bytes: int | None = None) -> Any:
  """`call()` (the worker's fwd_bwd or update), its computation handed to the watcher: queued
  once the call's inline preparation (if any) ended, its output watched off this lane."""
  placement, target = state.placement, state.target
  if target is None:  # a trainer staging cannot serve: nothing to watch
    return call()
  tracer = _unless_broken(inst, target, lambda: placement.tracer(target), TRACER)
  tracing: Any = None
  if tracer is not None:  # the plugin's spans on it (tracing.py), loaded only for a tracer
    from tunix_stage_plugin.hosts.tunix import tracing  # pylint: disable=import-outside-toplevel
    inst.trace_into(tracer, tracing.TracerSink)
  logger = _unless_broken(inst, target, lambda: placement.metrics_logger(target), LOGGER)
  if logger is not None:
    inst.log_into(logger, lambda: placement.step_sink(target, logger))
  started = time.perf_counter()
  inline = placements.Prepared()
  try:
    with inline, contextlib.ExitStack() as stack:
      device_span = (None if tracer is None else stack.enter_context(
          tracing.computation(tracer, target, peft.model_mesh(target.model))))
      result = call()
      output = _unless_broken(inst, target, lambda: placement.computation(target, kind), OUTPUT)
  finally:  # the call's inline preparation, where it prepared one, returned or raised
    if inline.span is not None:
      inst.recorder.add(tracks.TRAINER_H2D, "inline", *inline.span, lane="inline",
                        bytes=payload_bytes)
  if output is not None:
    queued = started if inline.span is None else max(started, inline.span[1])
    # An update answers the host's own step count (TrainerWorker.update -> int): the step its
    # loss is logged at, carried to the step's figures (`host_step`).
    step = {"host_step": int(result)} if kind == tracks.UPDATE and isinstance(
        result, (int, np.integer)) else {}
    inst.watcher(jax.block_until_ready, placement.host).dispatched(
        kind, queued, time.perf_counter(), output, on_ready=device_span, **step)
  elif device_span is not None:  # no output to watch: its device span ends with the call
    device_span()
  return result

