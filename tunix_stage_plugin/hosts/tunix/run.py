"""One staged train_stage run, the same for both ways of the loop (program.py): the core step loop
(core.pipeline.StagePipeline) over the program's engine, its calls (`StagingCalls`) made by
engine.py's functions through the one router the run holds, its keys carrying this process's
session (sessions.key_prefix), and each step's staging metrics on tunix's step result and, as
`stage/...` scalars, to the process's jax.monitoring listeners (metrics.py).
The loop's invariants: docs/design.md "Core semantics".
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from tunix.experimental.orchestrator import rl_program

from tunix_stage_plugin.core import codec_spec
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.core.telemetry import figures
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import engine as engine_lib
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import metrics
from tunix_stage_plugin.hosts.tunix import route
from tunix_stage_plugin.hosts.tunix import sessions


@dataclasses.dataclass(kw_only=True)
class StagedRLStepResult(rl_program.RLStepResult):
  """The host's step result plus the step's staging metrics (stage/fallbacks, ...)."""

  stage_metrics: dict[str, int] = dataclasses.field(default_factory=dict)


class StagingCalls:
  """The pipeline's three calls (core.pipeline.StageEngine: stage, train, reset) as engine.py's
  calls to the actor's trainer, each through `router`.

  With a codec (TUNIX_STAGE_CODEC) a stage's payload is compressed on a worker thread, never on
  the event loop; `raw_bytes` / `sent_bytes` count its array bytes before and after.
  """

  def __init__(self, engine: Any, router: route.Router, codec: str = codec_spec.OFF
               ) -> None:
    self._engine = engine
    self.router = router
    self.codec: Any = None  # core.codec.Codec, loaded only where a codec is set
    if codec != codec_spec.OFF:
      from tunix_stage_plugin.core import codec as codec_lib  # pylint: disable=import-outside-toplevel
      self.codec = codec_lib.parse(codec)
    self.raw_bytes = self.sent_bytes = 0
    self.auto: Any = None  # core.sizing.AutoDepth, told each stage's answer (a depth at auto)

  async def stage(self, payload: Any, *, key: str) -> outcome_lib.StageOutcome:
    if self.codec is not None:
      from tunix_stage_plugin.hosts.tunix import compression  # pylint: disable=import-outside-toplevel
      payload = await asyncio.to_thread(compression.compress, self.codec, payload)
      self.raw_bytes += payload.nbytes
      self.sent_bytes += payload.wire_bytes
    answer = await engine_lib.stage(self._engine, self.router, payload, key=key)
    if self.auto is not None:  # the trainer's newest step on it
      self.auto.answered(answer)
    return answer

  async def train(self, payload: Any, *, stage_key: str | None, apply_optimizer: bool
                  ) -> outcome_lib.Trained:
    return await engine_lib.train(self._engine, self.router, payload, stage_key=stage_key,
                                  apply_optimizer=apply_optimizer)

  async def reset(self, keys: list[str]) -> None:
    # Cleanup, often after a failed call: bounded by a short deadline of its own, never another
    # whole call deadline on a stopped trainer (a failed reset is kept and retried).
    await engine_lib.reset(self._engine, keys, timeout_s=engine_lib.RESET_TIMEOUT_S)


class Run:
  """One staged train_stage run (either way): the pipeline over the program's engine, the router
  its calls travel through (its stream channels closed with the run), and how each step's staging
  went."""

  def __init__(self, inst: installation_lib.Installation, program: Any, engine: Any,
               num_steps: int | None, *, open_ended: bool) -> None:
    config = inst.live.config
    self.inst = inst
    self.program = program
    self.engine = engine
    self.num_steps = num_steps
    self.router = route.router_of(inst, engine)
    self.calls = StagingCalls(engine, self.router, config.codec)
    inst.telemetry.orchestrator()  # this process orchestrates: its step figures listen
    if inst.first_time("orchestrator scalars"):  # and reach its jax.monitoring listeners
      inst.telemetry.add_step_sink(metrics.MonitoringSink(), record_lib.ORCHESTRATOR)
    # The program's seams (its subclass's overrides included) decide depth and prestage; at
    # auto the program's seam is asked with the sizer's choice and has the last word.
    seam = program._stage_ahead_while_pending  # pylint: disable=protected-access
    depth = config.max_staged_batches
    self.auto: Any = None  # core.sizing.AutoDepth, loaded only at auto
    if config_lib.is_auto(depth):
      from tunix_stage_plugin.core import sizing  # pylint: disable=import-outside-toplevel
      auto = self.auto = self.calls.auto = sizing.AutoDepth(config.memory_budget, inst.telemetry)
      depth = config_lib.fixed("max_staged_batches", depth)

      def depth_for(step: int, asked: int) -> int:
        depth = seam(step, auto.depth_for(step, asked))
        auto.host_chose(step, depth, "the program's _stage_ahead_while_pending")
        return depth
    else:
      depth_for = seam
    self.pipeline = pipeline_lib.StagePipeline(
        self.calls, depth,
        key_prefix=sessions.key_prefix(),  # this process's session
        recorder=inst.recorder, depth_for=depth_for, open_ended=open_ended,
        room=None if self.auto is None else self.auto.room)

  def may_prestage(self, next_step: int) -> bool:
    return self.pipeline.may_prestage(next_step, self.num_steps,
                                      self.program._prestage_across_boundary)  # pylint: disable=protected-access

  def step_result(self, result: Any, report: pipeline_lib.StepReport) -> StagedRLStepResult:
    """tunix's step result with the step's staging metrics; the step's figures recorded and
    said (the job's telemetry)."""
    depth = self.pipeline.depth if self.auto is None else self.auto.step_ended(report)
    self.inst.telemetry.orchestrator_step(
        report, depth, _codec_note(self.calls), host_step=contract.trained_step(report.result))
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    return StagedRLStepResult(**fields, stage_metrics=report.metrics())

  async def close(self) -> None:
    if self.auto is not None:
      self.auto.close()
    await self.router.close()  # the stream channels belong to this loop


def _codec_note(calls: StagingCalls) -> str:
  """The compressed stages so far, for the step's log line ("" without a codec)."""
  if calls.codec is None or not calls.sent_bytes:
    return ""
  return (f"; codec {calls.codec}: staged arrays {figures.size(calls.raw_bytes)} sent as "
          f"{figures.size(calls.sent_bytes)} (ratio {calls.raw_bytes / calls.sent_bytes:.2f})")
