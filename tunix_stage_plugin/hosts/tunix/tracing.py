"""Staging on tunix's own perf timelines, where the trainer has a tunix PerfTracer.

tunix's distributed path emits no span of its own (TrainerWorker.fwd_bwd and update never touch
the trainer's `perf_tracer_v2`), and its PerfTracer records spans opened on the thread doing the
work (a host timeline per thread). So where a PeftTrainer was given a `PerfTracer`, the plugin
opens on it, on the threads doing the work: each staging span (`stage_receive`, `stage_place`,
`stage_pool_wait`, `stage_fallback`: a live sink on the installation's recorder) and each
computation the worker runs (`peft_train`, tunix's own name, its device span ended by the
computation's output), so tunix's own export (PerfMetricsExport, its Perfetto writer) shows
staging next to the training it feeds. A trainer without one (tunix's NoopTracer, the default)
gets nothing. docs/observability.md "tunix's perf trace".
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from tunix.perf.experimental import constants as perf_constants
from tunix.perf.experimental import tracer as tracer_lib

from tunix_stage_plugin.core import timeline as timeline_lib
from tunix_stage_plugin.core import tracks

# The staging tracks tunix's timelines show, under tunix-style span names.
SPAN_NAMES = {
    tracks.TRAINER_RECEIVE: "stage_receive",
    tracks.TRAINER_H2D: "stage_place",
    tracks.TRAINER_POOL_WAIT: "stage_pool_wait",
    tracks.TRAINER_FALLBACK: "stage_fallback",
}


def tracer_of(trainer: Any) -> tracer_lib.PerfTracer | None:
  """The PerfTracer a PeftTrainer was given, or None (no tracer: tunix's NoopTracer)."""
  tracer = trainer._perf_tracer_v2  # pylint: disable=protected-access
  return tracer if isinstance(tracer, tracer_lib.PerfTracer) else None


class TracerSink:
  """A live sink (core.telemetry.recorder.LiveSink): the staging spans on `tracer`."""

  def __init__(self, tracer: tracer_lib.PerfTracer) -> None:
    self.tracer = tracer

  def record(self, span: timeline_lib.Span) -> None:
    del span  # the tracer timed it itself, live

  def open(self, track: str, name: str, args: dict[str, Any]
           ) -> contextlib.AbstractContextManager[Any]:
    span_name = SPAN_NAMES.get(track)
    if span_name is None:
      return contextlib.nullcontext()
    return self.tracer.span(span_name, tags={perf_constants.NAME: name, **args})


@contextlib.contextmanager
def computation(tracer: tracer_lib.PerfTracer, devices: Any, step: int, micro_batch: int | None
                ) -> Iterator[Any]:
  """A `peft_train` span around one fwd_bwd or update call; yield the waitlist, and hand it the
  computation's output (`async_end`) so its device span ends when the device does."""
  tags = {perf_constants.STEP: step, perf_constants.ROLE: "actor"}
  if micro_batch is not None:
    tags[perf_constants.MICRO_BATCH] = micro_batch
  with tracer.span(perf_constants.PEFT_TRAIN, devices, tags=tags) as waitlist:
    yield waitlist
