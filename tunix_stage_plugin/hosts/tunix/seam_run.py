"""The staged run through tunix's train loop seam (loop_seam.py's hooks call it): tunix's
train_stage calls `_train_microbatches` once per step, which trains the step through the core
pipeline, and makes the next step's micro-batches early, during this step's boundary, to stage
them across it. Loaded when a program first trains staged. docs/tunix.md "The train loop, two
ways".
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Callable

from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import run as run_lib


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


class SeamRun(run_lib.Run):
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
