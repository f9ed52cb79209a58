"""One staged train_stage run, either way of the train loop (hooks.py picks the way): the core step
loop (core.pipeline.StagePipeline) over the program's engine, its calls the orchestrator's side's
(`orchestrator.StagingCalls`), its keys carrying this process's session, and each step's staging
metrics on tunix's step result and, as `stage/...` scalars, to the process's jax.monitoring
listeners. `SeamRun` is the run through tunix's train loop seam: tunix's train_stage calls it once
per step, and it makes the next step's micro-batches early, during this step's boundary, to stage
them across it. Loaded where a program first trains staged: a trainer never loads it. The loop's
invariants: docs/design.md "Core semantics"; the ways: docs/tunix.md "The train loop, two ways".
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Callable

import jax
from tunix.experimental.orchestrator import rl_program

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import orchestrator as orchestrator_lib


@dataclasses.dataclass(kw_only=True)
class StagedRLStepResult(rl_program.RLStepResult):
  """The host's step result plus the step's staging metrics (stage/fallbacks, ...)."""

  stage_metrics: dict[str, int] = dataclasses.field(default_factory=dict)


class MonitoringSink:
  """A step sink of the orchestrator's figures: each step's scalars through
  `jax.monitoring.record_scalar` (names `stage/...`, where every metrics logger's backends
  listen), at the trainer's step count the step's last update answered (tunix's `train_step`,
  where the trainer logs that update's loss), or at the orchestrator's own step where the answer
  carried none."""

  def step(self, figures: dict[str, Any]) -> None:
    step = figures["step"] if figures["host_step"] is None else figures["host_step"]
    for name, value in figures_lib.scalars(figures_lib.ORCHESTRATOR, figures).items():
      jax.monitoring.record_scalar(name, value, step=step)


class Run:
  """One staged train_stage run (either way): the pipeline over the program's engine, and how each
  step's staging went."""

  def __init__(self, inst: installation_lib.Installation, program: Any, engine: Any,
               num_steps: int | None, *, open_ended: bool) -> None:
    config = inst.live.config
    self.inst = inst
    self.program = program
    self.engine = engine
    self.num_steps = num_steps
    self.side = inst.orchestrator_side()
    self.calls = orchestrator_lib.StagingCalls(self.side, engine, config.codec)
    inst.telemetry.orchestrator()  # this process orchestrates: its step figures listen
    if inst.first_time("orchestrator scalars"):  # and reach its jax.monitoring listeners
      inst.telemetry.add_step_sink(MonitoringSink(), record_lib.ORCHESTRATOR)
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
        self.calls, depth, key_prefix=contract.next_loop_prefix(), recorder=inst.recorder,
        depth_for=depth_for, open_ended=open_ended,
        room=None if self.auto is None else self.auto.room)

  def may_prestage(self, next_step: int) -> bool:
    return self.pipeline.may_prestage(next_step, self.num_steps,
                                      self.program._prestage_across_boundary)  # pylint: disable=protected-access

  def step_result(self, result: Any, report: pipeline_lib.StepReport) -> StagedRLStepResult:
    """tunix's step result with the step's staging metrics; the step's figures recorded and
    said (the job's telemetry)."""
    depth = self.pipeline.depth if self.auto is None else self.auto.step_ended(report)
    self.inst.telemetry.orchestrator_step(
        report, depth, self.calls.codec_note(), host_step=contract.trained_step(report.result))
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    return StagedRLStepResult(**fields, stage_metrics=report.metrics())

  async def close(self) -> None:
    if self.auto is not None:
      self.auto.close()
    await self.side.close_connections()  # the stream channels belong to this loop


@dataclasses.dataclass
class _Early:
  """The next step's micro-batches, made during this step's boundary, and their prestage."""

  microbatches: Any  # tunix's StepMicrobatches
  source: AsyncIterator[pipeline_lib.MicroBatch]
  prestage: pipeline_lib.Prestage


async def _as_microbatches(batches: AsyncIterator[tuple[Any, bool]]
                           ) -> AsyncIterator[pipeline_lib.MicroBatch]:
  """tunix's `(batch, apply_optimizer)` pairs as the pipeline's micro-batches."""
  async for batch, apply_optimizer in batches:
    yield pipeline_lib.MicroBatch(batch, closes_step=apply_optimizer)


class SeamRun(Run):
  """A run through tunix's seam: tunix's train_stage calls `train` once per step."""

  def __init__(self, inst: installation_lib.Installation, program: Any, engine: Any,
               num_steps: int | None, make_microbatches: Callable[[Any, Any], Any],
               early_ok: bool) -> None:
    super().__init__(inst, program, engine, num_steps, open_ended=True)
    self._make_microbatches = make_microbatches  # tunix's own _step_microbatches
    self._early_ok = early_ok  # the class keeps tunix's seam methods (else no prestage)
    self.early: _Early | None = None
    self.reports: dict[int, pipeline_lib.StepReport] = {}

  def early_microbatches(self) -> Any | None:
    """The micro-batches made for the step about to start, if they were made early."""
    return None if self.early is None else self.early.microbatches

  async def train(self, step: int, microbatches: Any) -> Any:
    """One step, staged: every micro-batch of `microbatches` trained once, in order; the last
    train call's result (None for a step without micro-batches), as tunix's seam answers."""
    early, self.early = self.early, None
    if early is not None and early.microbatches is not microbatches:
      await pipeline_lib.settle(early.prestage.discard())
      raise pipeline_lib.PipelineContractError(
          f"step {step} trains other micro-batches than the ones made for it during the last "
          "boundary (made by StandardRLProgram._step_microbatches)")
    source = early.source if early is not None else _as_microbatches(microbatches.batches)

    def after_final_dispatch() -> None:  # the update is sent: the next step may stage now
      if self._early_ok and self.may_prestage(step + 1):
        made = self._make_microbatches(self.program, self.engine)
        made_source = _as_microbatches(made.batches)
        self.early = _Early(made, made_source, self.pipeline.prestage(step + 1, made_source))

    report = await self.pipeline.run_step(step, source, prestaged=None if early is None
                                          else early.prestage,
                                          after_final_dispatch=after_final_dispatch)
    async for _ in source:  # tunix's contract: the optimizer-applying micro-batch is the last
      raise pipeline_lib.PipelineContractError(
          f"step {step}'s micro-batches went on after the one that applies the optimizer")
    self.reports = {step: report}  # read when tunix records the step's result
    return report.result

  async def close(self) -> None:
    early, self.early = self.early, None
    try:
      if early is not None:  # no step adopted it (the run ended or failed): release it
        await pipeline_lib.settle(early.prestage.discard())
    finally:
      await super().close()
