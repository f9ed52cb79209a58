"""StandardRLProgram: the staged train loop, used only when staging is on and the engine can stage.

Either way the loop is the core step loop's (core.pipeline.StagePipeline): micro-batch k+1 (and
k+2) staged while k trains, each trained exactly once and in order, the next step's first
micro-batches staged during this step's boundary (its update and weight sync), every staged key
released on every path. An engine that is not really a DistributedRLEngine (tunix's tests use
spec'd MagicMocks, which pass isinstance but are not engines) keeps tunix's loop. Two ways in, by
what this tunix has (probes.loop_way; docs/tunix.md "The train loop, two ways"):

- SEAM: a tunix with the train loop's seam (patches/tunix-plugins-entry-point.patch). tunix's
  train_stage runs as tunix wrote it, and so does the step's bookkeeping; the hooks are the seam:
  `_train_microbatches` (one step's per-micro-batch loop) becomes the staged step, and
  `_step_microbatches` hands back the next step's micro-batches when they were made early, to
  stage during the boundary. `train_stage` is wrapped, not replaced: the wrapper opens the staged
  run around tunix's own call (its `num_steps` says which step is the last; its exit releases
  what is staged). `last_step_result` becomes a property whose setter adds the step's `stage/*`
  metrics (a StagedRLStepResult) when tunix records the step, before `on_step_end`. A subclass
  that overrides either seam method is staged within each step but not across the boundary
  (micro-batches made early could not reach its override).
- COPY: tunix c7d8950, which has no seam. The plugin's copy of its train_stage replaces it: the
  core step loop fed from the program's scored queue in tunix's order (one group at a time,
  `assembler.pack`, the group's reference log-probs before any of its micro-batches trains; the
  step's last micro-batch applies the optimizer), the step's bookkeeping (callbacks, weight sync,
  policy version, commit, RLStepResult) reproduced. probes.py pins the body it reproduces by its
  fingerprint (a tunix whose loop changed is refused unless TUNIX_STAGE_ACCEPT_TRAIN_STAGE accepts
  it), with tunix's defaults where it reads one (an item's `traj.reward`, 0.0; its `payload`,
  None; the algorithm's `requires_reference_kl`, False). It differs from tunix's loop in two ways:
  the point of it (the next step's first groups leave the scored queue during this step's
  boundary, before `on_step_end(step)` and `on_step_begin(step + 1)` run; not at all with
  `max_staleness=0`), and a step with no optimizer-applying micro-batch (the scored queue cleared,
  `mini_batch_size` 0, a last group that packs into nothing) raises where tunix's loop ends the
  step without an update (micro-batches pulled ahead stay untrained, staged ones are released).

The loop asks the program at the upstream change's two seams, methods this module adds to
StandardRLProgram (removed exactly on uninstall) so that a subclass can override them:
`_stage_ahead_while_pending(step, max_staged_batches)`, how many micro-batches to keep staged
while a train call is pending (the pipeline's `depth_for`), and `_prestage_across_boundary(
next_step)`, whether to stage the next step's first micro-batches during the boundary (its
`prestage_next`). Prestage rules and the seams: docs/tunix.md.

Every call that carries a micro-batch (a stage, an inline train call, a fallback, the reference
log-probs request) takes the transport route.py picks for it (docs/design.md "A micro-batch's
way").
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import logging
from typing import Any, AsyncIterator, Callable

import numpy as np
from tunix.experimental.common import datatypes
from tunix.experimental.orchestrator import rl_program

from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import outcome as outcome_lib
from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.hosts import probing
from tunix_stage_plugin.hosts.tunix import compression
from tunix_stage_plugin.hosts.tunix import contract
from tunix_stage_plugin.hosts.tunix import engine as engine_lib
from tunix_stage_plugin.hosts.tunix import installation as installation_lib
from tunix_stage_plugin.hosts.tunix import probes
from tunix_stage_plugin.hosts.tunix import request as request_lib
from tunix_stage_plugin.hosts.tunix import route
from tunix_stage_plugin.hosts.tunix import sessions

log = logging.getLogger("tunix_stage_plugin")
ACTOR = datatypes.Role.ACTOR


@dataclasses.dataclass(kw_only=True)
class StagedRLStepResult(rl_program.RLStepResult):
  """The host's step result plus the step's staging metrics (stage/fallbacks, ...)."""

  stage_metrics: dict[str, int] = dataclasses.field(default_factory=dict)


class StagingCalls:
  """The pipeline's three calls (core.pipeline.StageEngine: stage, train, reset) as calls of
  tunix's DistributedRLEngine; an inline train call is tunix's train_step, over the transport
  `router` picks (route.py).

  With a codec (TUNIX_STAGE_CODEC) a stage's payload is compressed on a worker thread, never on
  the event loop; `raw_bytes` / `sent_bytes` count its array bytes before and after.
  """

  def __init__(self, engine: Any, router: route.Router,
               codec: codec_lib.Codec | None = None) -> None:
    self._engine = engine
    self.router = router
    self.codec = codec
    self.raw_bytes = self.sent_bytes = 0

  async def stage(self, payload: Any, *, key: str) -> outcome_lib.StageOutcome:
    if self.codec is not None:
      payload = await asyncio.to_thread(compression.compress, self.codec, payload)
      self.raw_bytes += payload.nbytes
      self.sent_bytes += payload.wire_bytes
    return await self._engine.stage_train_batch(payload, key=key, role=ACTOR)

  async def train(self, payload: Any, *, stage_key: str | None, apply_optimizer: bool
                  ) -> outcome_lib.Trained:
    if stage_key is None:  # tunix's own train_step call, over the transport the router picks
      return outcome_lib.Trained(await route.train_step(
          self._engine, self.router, payload, role=ACTOR, accumulate_gradients=True,
          apply_optimizer=apply_optimizer))
    try:
      result = await self._engine.train_step(None, role=ACTOR, accumulate_gradients=True,
                                             apply_optimizer=apply_optimizer,
                                             **{contract.STAGE_KEY: stage_key})
    except RuntimeError as e:  # tunix's remote-error envelope
      remote = contract.RemoteError.of(e)
      if remote is not None and remote.type_name == outcome_lib.StagedPayloadUnreadable.__name__:
        raise outcome_lib.StagedPayloadUnreadable(remote.message) from e
      raise
    # train_step answers fwd_bwd's response, or {"fwd_bwd": response, ...} after an update.
    response = result["fwd_bwd"] if apply_optimizer else result
    return outcome_lib.Trained(result, fallback=contract.placement_fallback(response))

  async def reset(self, keys: list[str]) -> None:
    # Cleanup, often after a failed call: bounded by a short deadline of its own, never another
    # whole call deadline on a stopped trainer (a failed reset is kept and retried).
    await self._engine.reset_staged_batches(keys, role=ACTOR,
                                            timeout_s=engine_lib.RESET_TIMEOUT_S)


class _Run:
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
    self.calls = StagingCalls(engine, self.router, codec_lib.parse(config.codec))
    inst.telemetry.orchestrator()  # this process orchestrates: its step figures listen
    # The program's seams (its subclass's overrides included) decide depth and prestage.
    self.pipeline = pipeline_lib.StagePipeline(
        self.calls, config.max_staged_batches,
        key_prefix=sessions.key_prefix(),  # this process's session
        recorder=inst.recorder,
        depth_for=program._stage_ahead_while_pending,  # pylint: disable=protected-access
        open_ended=open_ended)

  def may_prestage(self, next_step: int) -> bool:
    return self.pipeline.may_prestage(next_step, self.num_steps,
                                      self.program._prestage_across_boundary)  # pylint: disable=protected-access

  def step_result(self, result: Any, report: pipeline_lib.StepReport) -> StagedRLStepResult:
    """tunix's step result with the step's staging metrics; the step's figures recorded and
    said (the job's telemetry)."""
    self.inst.telemetry.orchestrator_step(report, self.pipeline.depth, _codec_note(self.calls))
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
    return StagedRLStepResult(**fields, stage_metrics=report.metrics())

  async def close(self) -> None:
    await self.router.close()  # the stream channels belong to this loop


def _codec_note(calls: StagingCalls) -> str:
  """The compressed stages so far, for the step's log line ("" without a codec)."""
  if calls.codec is None or not calls.sent_bytes:
    return ""
  mib = request_lib.MIB
  return (f"; codec {calls.codec}: staged arrays {calls.raw_bytes / mib:.1f} MiB sent as "
          f"{calls.sent_bytes / mib:.1f} MiB (ratio {calls.raw_bytes / calls.sent_bytes:.2f})")


def _may_prestage(inst: installation_lib.Installation, program: Any) -> bool:
  """Cross-step prestage needs the next step's rollouts before the weight sync ends."""
  if program.max_staleness == 0:
    if inst.first_time("no-prestage-at-max-staleness-0"):
      log.info("tunix-stage: no cross-step prestage: max_staleness=0 holds the next step's "
               "rollouts until the weight sync ends; it needs max_staleness >= 1 (or None)")
    return False
  return True


# ---------------------------------------------------------------- COPY: a tunix without the seam


@dataclasses.dataclass
class _StepFeed:
  """One step's micro-batch source and what it pulled (a prestaged step keeps its own feed)."""

  source: AsyncIterator[pipeline_lib.MicroBatch] | None = None
  groups: list[list[Any]] = dataclasses.field(default_factory=list)
  rewards: list[float] = dataclasses.field(default_factory=list)
  num_microbatches: int = 0


async def _microbatches(program: Any, engine: Any, feed: _StepFeed
                        ) -> AsyncIterator[pipeline_lib.MicroBatch]:
  for group_idx in range(program.mini_batch_size):
    items = await program.scored_q.get_batch(num_groups=1)
    if not items:
      raise RuntimeError(
          f"the scored queue returned no group ({group_idx} of {program.mini_batch_size} pulled "
          "this step: it was cleared); tunix's loop would end the step without an update, the "
          "staged loop cannot (docs/tunix.md)")
    feed.groups.append(items)
    # tunix's loop reads these three with defaults (a dict traj has no .reward; an item or an
    # algorithm may lack the attribute): the same defaults here.
    feed.rewards.extend(float(getattr(item.traj, "reward", 0.0)) for item in items)
    batches = program.assembler.pack([getattr(item, "payload", None) for item in items])
    if getattr(program.algo, "requires_reference_kl", False):
      # The whole group's, before any of it trains (tunix's order: a micro-batch that cannot take
      # them stops the group before any of its micro-batches is trained).
      batches = [await _with_reference_logps(engine, batch) for batch in batches]
    feed.num_microbatches += len(batches)
    closing_group = group_idx == program.mini_batch_size - 1
    for i, batch in enumerate(batches):
      yield pipeline_lib.MicroBatch(batch, closes_step=closing_group and i == len(batches) - 1)


async def _with_reference_logps(engine: Any, batch: Any) -> Any:
  # pylint: disable=import-outside-toplevel  (tunix's modules the copy of its loop reads)
  from tunix.experimental.orchestrator import batch_assembly
  from tunix.rl import common as rl_common
  if not isinstance(batch, rl_common.TrainExample):
    raise TypeError("Reference KL requires an assembler that returns rl_common.TrainExample "
                    f"microbatches; got {type(batch).__name__}.")
  # The engine's hook sends it over the side channel or the stream when the call is large.
  logps = await engine.per_token_logps(datatypes.Role.REFERENCE, items=batch)
  return batch_assembly.with_ref_per_token_logps(batch, logps)


async def _copy_train_stage(run: _Run) -> None:
  program, engine = run.program, run.engine
  feeds: dict[int, _StepFeed] = {}  # a prestaged step keeps its own feed

  def source_for(step: int) -> AsyncIterator[pipeline_lib.MicroBatch]:
    feed = feeds[step] = _StepFeed()
    feed.source = _microbatches(program, engine, feed)  # it records into its own feed
    return feed.source

  def before_step(step: int) -> None:
    if program.on_step_begin:
      program.on_step_begin(program.step)

  async def after_step(step: int, report: pipeline_lib.StepReport) -> None:
    # From here on, the host's own step bookkeeping.
    feed = feeds.pop(step)
    if program.sync_weights:
      new_version = await engine.sync_weights(role=ACTOR)
      program.policy_version = new_version if new_version else program.step + 1
    else:
      program.policy_version = program.step + 1
    program.scored_q.commit(step, groups=feed.groups)
    program.last_step_result = run.step_result(rl_program.RLStepResult(
        step=step,
        policy_version=program.policy_version,
        num_rollouts=sum(len(g) for g in feed.groups),
        num_microbatches=feed.num_microbatches,
        reward_mean=float(np.mean(feed.rewards)) if feed.rewards else 0.0,
        reward_std=float(np.std(feed.rewards)) if feed.rewards else 0.0,
        train_result=report.result,
    ), report)
    if program.on_step_end:
      program.on_step_end(program.step, report.result)

  await run.pipeline.run_steps(source_for, steps=run.num_steps,
                               prestage_next=program._prestage_across_boundary,  # pylint: disable=protected-access
                               before_step=before_step, after_step=after_step)


def _apply_copy(registry: patching.PatchRegistry, inst: installation_lib.Installation,
                program_cls: type, engine_cls: type) -> None:
  original_train_stage = program_cls.__dict__["train_stage"]
  found = probing.fingerprint(original_train_stage)
  if found != probes.TRAIN_STAGE_FINGERPRINT:  # passed the probe: the setting accepts it
    log.warning("tunix-stage: the staged loop replaces a StandardRLProgram.train_stage whose body "
                "(fingerprint %s) is not tunix %s's (%s): accepted by %s", found,
                probes.TRAIN_STAGE_COMMIT, probes.TRAIN_STAGE_FINGERPRINT, probes.ACCEPT.env)

  @functools.wraps(original_train_stage)
  async def train_stage(self: Any, engine: Any, num_steps: int | None = None) -> None:
    # The real type: a MagicMock(spec=DistributedRLEngine) passes isinstance, and would answer
    # stage_train_batch with a mock; the host's loop is the right one for it.
    if not issubclass(type(engine), engine_cls):
      return await original_train_stage(self, engine, num_steps)
    run = _Run(inst, self, engine, num_steps, open_ended=False)
    try:
      return await _copy_train_stage(run)
    finally:
      await run.close()

  registry.set(program_cls, "train_stage", train_stage)


# ---------------------------------------------------------------- SEAM: tunix's loop, its seam


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


class _SeamRun(_Run):
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


def _apply_seam(registry: patching.PatchRegistry, inst: installation_lib.Installation,
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
      log.info("tunix-stage: %s overrides %s: its steps are staged within themselves, not "
               "across the step boundary (micro-batches made early could not reach its "
               "override)", type(self).__qualname__, ", ".join(own))
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

  def get_last_step_result(self: Any) -> Any:
    try:
      return self.__dict__["last_step_result"]
    except KeyError:
      raise AttributeError(f"{type(self).__name__!r} object has no attribute "
                           "'last_step_result'") from None

  def set_last_step_result(self: Any, value: Any) -> None:
    run = run_of(self)  # tunix records a step's result: add the step's staging metrics
    if run is not None and type(value) is rl_program.RLStepResult and value.step in run.reports:
      value = run.step_result(value, run.reports.pop(value.step))
    self.__dict__["last_step_result"] = value

  hooks = {"_step_microbatches": _step_microbatches, "_train_microbatches": _train_microbatches}
  registry.set(program_cls, "train_stage", train_stage)
  for name, hook in hooks.items():
    registry.set(program_cls, name, functools.wraps(program_cls.__dict__[name])(hook))
    hooks[name] = program_cls.__dict__[name]  # what a subclass that does not override finds
  registry.set(program_cls, "last_step_result",
               property(get_last_step_result, set_last_step_result))


def _stage_ahead_while_pending(self: Any, step: int, max_staged_batches: int) -> int:
  """How many of step `step`'s micro-batches to keep staged ahead while a train call is pending.

  Added by tunix-stage-plugin while staging is installed (the upstream change's name). Default:
  `max_staged_batches` (TUNIX_MAX_STAGED_BATCHES / --max_staged_batches). Asked once per step, when
  its staging starts (at the step's start, or at the previous boundary when it is prestaged). 0
  stages none of the step (it trains inline); more than the trainer's device bound is refused
  there and trained inline. Override in a subclass, e.g. a smaller depth while it evaluates.
  """
  del self, step
  return max_staged_batches


def apply(registry: patching.PatchRegistry, inst: installation_lib.Installation,
          program_cls: type, engine_cls: type) -> None:

  def _prestage_across_boundary(self: Any, next_step: int) -> bool:
    """Whether to stage step `next_step`'s first micro-batches while this step's boundary
    (update, weight sync) runs.

    Added by tunix-stage-plugin while staging is installed (the upstream change's name). Default:
    yes, unless `max_staleness=0` (the next step's rollouts then wait for the weight sync). Asked
    once per step boundary that has a next step. Override in a subclass, e.g. to skip the
    prestage at its own checkpoint boundaries.
    """
    del next_step
    return _may_prestage(inst, self)

  if probes.loop_way(program_cls) == probes.SEAM:
    _apply_seam(registry, inst, program_cls, engine_cls)
  else:
    _apply_copy(registry, inst, program_cls, engine_cls)
  registry.set(program_cls, "_stage_ahead_while_pending", _stage_ahead_while_pending)
  registry.set(program_cls, "_prestage_across_boundary", _prestage_across_boundary)
