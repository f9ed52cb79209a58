"""The SEAM way of the staged loop, for a tunix with the train loop's seam
(patches/tunix-plugins-entry-point.patch): tunix's train_stage and the step's bookkeeping run as
tunix wrote them; the hooks are the seam (`_train_microbatches`, `_step_microbatches`, a wrapped
`train_stage`, and `last_step_result` as a property adding the step's `stage/*` metrics). A
subclass overriding a seam method is not staged across the boundary; one whose
`_train_microbatches` never calls tunix's is not staged at all (said at its first step that could
have staged). Here too the seam's probe (`PROBE`). Loaded at install only on such a tunix; the
staged run (run.py) where a program first trains staged. docs/tunix.md "The train loop, two ways".
"""

from __future__ import annotations

import ast
import contextvars
import dataclasses
import functools
import logging
from typing import Any

from tunix_stage_plugin.core import patching
from tunix_stage_plugin.hosts import probing
from tunix_stage_plugin.hosts.probing import has_all, has_method, is_free, that
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import probes

log = logging.getLogger("tunix_stage_plugin")

STEP_MICROBATCHES_FIELDS = frozenset({"batches", "groups", "rewards", "num_rollouts",
                                      "num_microbatches"})


def _train_stage(t: probes.Tunix) -> probing.Body:
  return probing.Body(t.program.train_stage)


def _trains_each_microbatch(t: probes.Tunix) -> bool:
  """_train_microbatches calls engine.train_step(..., accumulate_gradients=, apply_optimizer=) in
  its async loop over microbatches.batches."""
  seam = probing.Body(t.program._train_microbatches)  # pylint: disable=protected-access
  trains = [c for f in seam.iterates("microbatches.batches", is_async=True)
            for c in ast.walk(f) if isinstance(c, ast.Call)
            and probing.dotted(c.func) == "engine.train_step"]
  return any({"accumulate_gradients", "apply_optimizer"} <= probing.keywords(c) for c in trains)


# The seam's probe (probes.py runs it), by its parsed code: train_stage makes each step's
# micro-batches, trains them through _train_microbatches and records the step's result;
# _train_microbatches is the per-micro-batch loop the staged one stands in for.
PROBE: tuple[str, tuple[probing.Check, ...]] = (
    "program: the train loop's seam (_step_microbatches, _train_microbatches)", (
        that(lambda t: dataclasses.is_dataclass(getattr(t.program_module, "StepMicrobatches",
                                                        None)),
             "rl_program.StepMicrobatches (a dataclass) is missing"),
        has_all("rl_program.StepMicrobatches",
                lambda t: {f.name for f in dataclasses.fields(t.program_module.StepMicrobatches)},
                sorted(STEP_MICROBATCHES_FIELDS)),
        has_method("program", "_step_microbatches", params=("engine",), coroutine=False,
                   own=True),
        has_method("program", "_train_microbatches", params=("engine", "step", "microbatches"),
                   coroutine=True, own=True),
        is_free("program", "last_step_result"),
        that(lambda t: _train_stage(t).call_order("self._step_microbatches",
                                                  "self._train_microbatches")
             == ["self._step_microbatches", "self._train_microbatches"],
             "StandardRLProgram.train_stage does not call self._step_microbatches, then "
             "self._train_microbatches"),
        that(lambda t: not _train_stage(t).calls("engine.train_step"),
             "StandardRLProgram.train_stage calls engine.train_step itself, beside the seam"),
        that(lambda t: _train_stage(t).assigns("self.last_step_result"),
             "StandardRLProgram.train_stage does not assign self.last_step_result"),
        that(_trains_each_microbatch,
             "StandardRLProgram._train_microbatches does not call engine.train_step(..., "
             "accumulate_gradients=, apply_optimizer=) for each of microbatches.batches")))


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation,
              program_cls: type, engine_cls: type) -> None:
  original_train_stage = program_cls.__dict__["train_stage"]
  original_step = program_cls.__dict__["_step_microbatches"]
  original_train = program_cls.__dict__["_train_microbatches"]
  # The run of the train_stage whose task (context) is running.
  current: contextvars.ContextVar[Any] = contextvars.ContextVar("tunix_stage_seam_run",
                                                                default=None)

  def run_of(program: Any) -> Any:
    """The run.SeamRun of `program`'s train_stage in this task, or None."""
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
    # pylint: disable-next=import-outside-toplevel  (the loop loads where a program trains staged)
    from tunix_stage_plugin.core import pipeline as pipeline_lib
    from tunix_stage_plugin.hosts.tunix import run as run_lib  # pylint: disable=import-outside-toplevel
    run = run_lib.SeamRun(inst, self, engine, num_steps, original_step, early_ok=not own)
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

  def say_unstaged(program: Any, result: Any) -> None:
    """A step that trained micro-batches without the seam: staged none of them. Said once per
    program class, with why."""
    cls = type(program)
    if not inst.first_time(f"seam-never-called:{cls.__qualname__}"):
      return
    why = (f"{cls.__qualname__}._train_microbatches overrides tunix's without calling it (call "
           "super()._train_microbatches(engine, step, microbatches) in it to stage)"
           if cls._train_microbatches is not hooks["_train_microbatches"] else
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
    if run is not None and type(value) is inst.modules.program.RLStepResult:
      if value.step in run.reports:
        value = run.step_result(value, run.reports.pop(value.step))
      elif value.num_microbatches:
        say_unstaged(self, value)
    self.__dict__["last_step_result"] = value

  hooks = {"_step_microbatches": _step_microbatches, "_train_microbatches": _train_microbatches}
  registry.set(program_cls, "train_stage", train_stage)
  for name, hook in hooks.items():
    registry.set(program_cls, name, functools.wraps(program_cls.__dict__[name])(hook))
    hooks[name] = program_cls.__dict__[name]  # what a subclass that does not override finds
  registry.set(program_cls, "last_step_result",
               property(get_last_step_result, set_last_step_result))
