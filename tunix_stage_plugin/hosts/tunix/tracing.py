"""Staging on tunix's own perf timelines, where the trainer has a tunix PerfTracer.

tunix's distributed path emits no span of its own, so where a PeftTrainer was given a `PerfTracer`
the plugin adds each staging span the trainer's recorder sees, and a `peft_train` span for each
fwd_bwd and update the worker runs, so tunix's own export shows staging next to the training it
feeds. Both clocks are perf_counter, so a span keeps its own times; a device span ends when the
plugin's compute watcher sees the output ready (no second wait). A trainer without one (tunix's
NoopTracer) gets nothing. docs/observability.md "tunix's perf trace".
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

from tunix.perf.experimental import constants as perf_constants
from tunix.perf.experimental import tracer as tracer_lib

from tunix_stage_plugin.core.telemetry import figures
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib


class TracerSink:
  """A telemetry sink (core.telemetry.recorder.Sink): the staging spans on `tracer`'s timelines.

  tunix's PerfTracer opens host spans only around a block on the thread running it; a staging
  span is known once it ended (a receive ends on a listener's thread or the event loop), so it is
  added with its own times to a host timeline of the tracer's that only this sink writes, one per
  kind of span (`PerfTracer._get_or_create_host_timeline`), as a span started and stopped at
  once."""

  def __init__(self, tracer: tracer_lib.PerfTracer) -> None:
    self.tracer = tracer

  def record(self, span: recorder_lib.Span) -> None:
    name = figures.SPANS.get(span.track)
    if name is None:
      return
    timeline = self.tracer._get_or_create_host_timeline(f"tunix-stage/{name}")  # pylint: disable=protected-access
    timeline.start_span(name, span.start, tags={perf_constants.NAME: span.name, **dict(span.args)})
    timeline.stop_span(span.end)


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
