"""The SEAM way of the staged loop (program.py), for a tunix with the train loop's seam
(patches/tunix-plugins-entry-point.patch): tunix's train_stage and the step's bookkeeping run as
tunix wrote them; the hooks are the seam (`_train_microbatches`, `_step_microbatches`, a wrapped
`train_stage`, and `last_step_result` as a property adding the step's `stage/*` metrics).
What each hook does, why a subclass overriding a seam method is not staged across the
boundary, and why one whose `_train_microbatches` never calls tunix's is not staged at all (said
at its first step that could have staged): docs/tunix.md "The train loop, two ways".
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
from typing import Any, AsyncIterator, Callable

from tunix.experimental.orchestrator import rl_program

from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import probes
from tunix_stage_plugin.hosts.tunix import run as run_lib

log = logging.getLogger("tunix_stage_plugin")


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


class _SeamRun(run_lib.Run):
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


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation,
                program_cls: type, engine_cls: type) -> None:
  original_train_stage = program_cls.__dict__["train_stage"]
  original_step = program_cls.__dict__["_step_microbatches"]
  original_train = program_cls.__dict__["_train_microbatches"]
  # The run of the train_stage whose task (context) is running.
  current: contextvars.ContextVar[_SeamRun | None] = contextvars.ContextVar(
      "tunix_stage_seam_run", default=None)

  def run_of(program: Any) -> _SeamRun | None:
    run = current.get()
    return run if run is not None and run.program is program else None

  @functools.wraps(original_train_stage)
  async def train_stage(self: Any, engine: Any, num_steps: int | None = None) -> None:
    # The real type: a MagicMock(spec=DistributedRLEngine) passes isinstance; tunix's loop,
    # with nothing staged, is the right one for it.
    if not issubclass(type(engine), engine_cls):
      return await original_train_stage(self, engine, num_steps)
    own = [m for m in probes.SEAM_METHODS if getattr(type(self), m) is not hooks[m]]
    if own and inst.first_time(f"seam-overridden:{type(self).__qualname__}"):
      log.info("tunix-stage: %s overrides %s: its steps are staged only where it calls tunix's "
               "(super()), and never across the step boundary (micro-batches made early could "
               "not reach its override)", type(self).__qualname__, ", ".join(own))
    run = _SeamRun(inst, self, engine, num_steps, original_step, early_ok=not own)
    token = current.set(run)
    try:
      return await original_train_stage(self, engine, num_steps)  # tunix's, as it wrote it
    finally:
      current.reset(token)
      await pipeline_lib.settle(run.close())

  def _step_microbatches(self: Any, engine: Any) -> Any:
    run = run_of(self)
    early = None if run is None else run.early_microbatches()
    return early if early is not None else original_step(self, engine)

  async def _train_microbatches(self: Any, engine: Any, step: int, microbatches: Any) -> Any:
    run = run_of(self)
    if run is None or engine is not run.engine:
      return await original_train(self, engine, step, microbatches)
    return await run.train(step, microbatches)

  def _say_unstaged(program: Any, result: Any) -> None:
    """A step that trained micro-batches without the seam: staged none of them. Said once per
    program class, with why."""
    cls = type(program)
    if not inst.first_time(f"seam-never-called:{cls.__qualname__}"):
      return
    hook = hooks["_train_microbatches"]
    why = (f"{cls.__qualname__}._train_microbatches overrides tunix's without calling it (call "
           "super()._train_microbatches(engine, step, microbatches) in it to stage)"
           if cls._train_microbatches is not hook else
           "tunix's train_stage trained this step without it")
    log.warning("tunix-stage: step %d staged 0 of %d micro-batches: the seam "
                "StandardRLProgram._train_microbatches was never called; %s", result.step,
                result.num_microbatches, why)

  def get_last_step_result(self: Any) -> Any:
    try:
      return self.__dict__["last_step_result"]
    except KeyError:
      raise AttributeError(f"{type(self).__name__!r} object has no attribute "
                           "'last_step_result'") from None

  def set_last_step_result(self: Any, value: Any) -> None:
    run = run_of(self)  # tunix records a step's result: add the step's staging metrics
    if run is not None and type(value) is rl_program.RLStepResult:
      if value.step in run.reports:
        value = run.step_result(value, run.reports.pop(value.step))
      elif value.num_microbatches:
        _say_unstaged(self, value)
    self.__dict__["last_step_result"] = value

  hooks = {"_step_microbatches": _step_microbatches, "_train_microbatches": _train_microbatches}
  registry.set(program_cls, "train_stage", train_stage)
  for name, hook in hooks.items():
    registry.set(program_cls, name, functools.wraps(program_cls.__dict__[name])(hook))
    hooks[name] = program_cls.__dict__[name]  # what a subclass that does not override finds
  registry.set(program_cls, "last_step_result",
               property(get_last_step_result, set_last_step_result))
