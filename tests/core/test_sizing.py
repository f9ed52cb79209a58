"""Staging that sizes itself, its two parts on real objects (docs/configuration.md "Staging that
sizes itself"): the trainer's host bound (core.host_bound.HostBound, a trainer step sink) applied to
a real store and receive pool from figures a real trainer aggregator makes of its spans; the
depth's rule (core.sizing.Sizer) on a trainer's step numbers, which ride on each stage answer
through the real step loop; and a depth that changes each step through the real step loop and
store.
"""

from __future__ import annotations

import asyncio

from tests.core.engines import ThreadedEngine, source_of
from tunix_stage_plugin.transport import listener as buffers_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import host_bound as host_bound_lib
from tunix_stage_plugin.core import sizing
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.pipeline import StagePipeline, StepReport
from tunix_stage_plugin.core.telemetry import recorder as trainer_lib
from tunix_stage_plugin.core.telemetry.recorder import Recorder, Span

MIB = 1 << 20
DEVICE = 1


def compute(kind, start, end):
  return Span(tracks.DEVICE_COMPUTE, kind, start, end, (("kind", kind),))


def step_spans(t, *, waited):
  """One trainer step from `t` (2 s): two fwd_bwd and an update, a 16 MiB micro-batch received
  between them; `waited`: the receive waited 0.3 s for a buffer and the compute 0.4 s for it."""
  gap = 0.4 if waited else 0.0
  spans = [compute("fwd_bwd", t, t + 0.5),
           Span(tracks.TRAINER_RECEIVE, "stage_batch", t + 0.1, t + 0.5 + gap,
                (("bytes", 16 * MIB), ("transport", "side"))),
           Span(tracks.TRAINER_H2D, "m", t + 0.5 + gap, t + 0.55 + gap,
                (("bytes", 16 * MIB), ("lane", "staging"))),
           compute("fwd_bwd", t + 0.55 + gap, t + 1.5),
           compute("update", t + 1.5, t + 2.0)]
  if waited:
    spans.append(Span(tracks.TRAINER_POOL_WAIT, "pool wait", t + 0.1, t + 0.4,
                      (("bytes", 16 * MIB), ("over", False))))
  return spans


class Trainer:
  """A real store and receive pool, and the host-bound sink on a real trainer aggregator."""

  def __init__(self, budget_bytes):
    self.store = store_lib.StagedBatchStore(DEVICE, max_host_batches=1)
    self.pool = buffers_lib.HostBufferPool()
    self.pool.set_bound(DEVICE + 1)
    self.reasons = []
    self.sink = host_bound_lib.HostBound(budget_bytes=budget_bytes, device_bound=DEVICE,
                                 apply=self.apply)
    self.steps = trainer_lib.TrainerSteps(self.sink.step)
    self.t = 0.0

  def apply(self, bound, reason):
    self.store.set_bounds(DEVICE, bound)
    self.pool.set_bound(DEVICE + bound)
    self.reasons.append(reason)

  def run(self, *waited):
    for w in waited:
      for span in sorted(step_spans(self.t, waited=w), key=lambda s: s.end):
        self.steps.record(span)
      self.t += 2.0
    return self.store.max_host_batches


def test_the_host_bound_grows_on_waits_within_the_budget_and_shrinks_after_quiet_steps():
  trainer = Trainer(budget_bytes=1 << 30)
  # The first step is not judged (it compiles); two steps in which transfers waited for a buffer
  # and the trainer then waited for its input: one more receive buffer.
  assert trainer.run(True, True) == 2 and trainer.pool.bound == DEVICE + 2
  assert trainer.reasons[-1].startswith("host bound 2: receive-pool wait ")
  assert trainer.reasons[-1].endswith("; budget 1.00 GiB, 48.0 MiB used")
  assert trainer.run(True) == 3  # the steps at the new bound only decide the next
  assert trainer.run(False, False) == 3 and "in 2 step(s)" in trainer.reasons[-1]
  assert trainer.run(False) == 2  # 3 steps in which no transfer waited for a buffer
  assert trainer.reasons[-1].startswith("host bound 2: no transfer waited for a buffer in 3 steps")
  assert trainer.run(False, False, False) == 1
  assert trainer.run(False, False, False, False) == 1  # never below 1


def test_the_host_bound_never_exceeds_the_budget():
  # (device 1 + host 1 + 1) x 16 MiB = 48 MiB > 40 MiB: kept at 1, said why.
  trainer = Trainer(budget_bytes=40 * MIB)
  assert trainer.run(True, True, True) == 1 and trainer.pool.bound == DEVICE + 1
  assert trainer.reasons[-1].startswith("host bound 1: kept, one more receive buffer would "
                                        "exceed the budget (receive-pool wait ")


def test_a_shrink_drops_no_received_batch():
  trainer = Trainer(budget_bytes=1 << 30)
  trainer.run(True, True)
  keys = [f"{contract.run_prefix()}-k{i}" for i in range(3)]
  for key in keys[:2]:  # two received, their placements not yet run (no placer)
    assert trainer.store.receive(key, key).staged
  trainer.run(False, False, False, False)
  assert trainer.store.max_host_batches == 1
  assert trainer.store.keys() == keys[:2]  # still held, to be trained
  trainer.store.slot_wait_s = 0.0
  assert not trainer.store.receive(keys[2], keys[2]).staged
  assert trainer.store.stats.refused == 1


def test_a_depth_that_changes_every_step_drops_and_resends_nothing():
  """Deeper, shallower, none, deeper again (each step's staging starting at the boundary before
  it), through the real step loop and a two-phase store: each micro-batch staged at most once
  and trained once, in order; nothing left staged."""
  engine = ThreadedEngine(3, max_host_batches=2)
  depths = {0: 3, 1: 1, 2: 0, 3: 3, 4: 1}
  payloads = [[f"s{s}m{i}" for i in range(5)] for s in depths]

  try:
    asyncio.run(StagePipeline(engine, 2, depth_for=lambda step, depth: depths[step]).run_steps(
        lambda s: source_of(payloads[s]), steps=len(depths)))
  finally:
    engine.close()
  flat = [p for step in payloads for p in step]
  assert engine.trained == flat
  staged = [p for p, attempt in engine.attempts]
  assert len(staged) == len(set(staged))  # none staged twice
  assert not any(p.startswith("s2") for p in staged)  # depth 0: none of step 2 staged
  assert len(engine.store) == 0


class Telemetry:
  """What AutoDepth tells the process's telemetry (it reads none of it)."""

  def __init__(self):
    self.said = []
    self.recorder = Recorder()  # AutoDepth listens to what the process sends

  def sized(self, role, field, value, reason):
    self.said.append((role, field, value, reason))


def test_a_trainer_that_cannot_stage_leaves_the_default_depth_said_once(caplog):
  """A stage answered UNSUPPORTED (a trainer without the plugin): no step numbers will come."""
  auto = sizing.AutoDepth(1 << 30, Telemetry())
  depths = []
  for step in range(3):
    depths.append(auto.depth_for(step, 2))
    auto.answered(contract.unsupported(f"k{step}", "the trainer has no stage_batch"))
    auto.step_ended(StepReport(step, peak_staged=1))
  auto.close()
  assert depths == [2, 2, 2]  # the default from the start, and once it cannot learn
  assert auto.sizer.held(2).reason == ("depth 2: the default, the trainer sends no figures (the "
                                         "trainer has no stage_batch); budget 1.00 GiB, a "
                                         "micro-batch's size not known yet")
  said = [r.message for r in caplog.records if "no step figures" in r.message]
  assert said == ["tunix-stage: TUNIX_MAX_STAGED_BATCHES=auto: the trainer sends no step figures "
                  "(the trainer has no stage_batch); staging at the default depth 2 from now on"]


def test_the_host_s_own_seam_has_the_last_word_and_is_said():
  telemetry = Telemetry()
  auto = sizing.AutoDepth(1 << 30, telemetry)
  assert auto.depth_for(0, 2) == 2
  auto.host_chose(0, 0, "the program's _stage_ahead_while_pending")
  assert auto.step_ended(StepReport(0)) == 0
  (said,) = telemetry.said
  assert said == ("orchestrator", "max_staged_batches", 0, "depth 0: the program's "
                  "_stage_ahead_while_pending (auto chose depth 2: the default (no step measured "
                  "yet); budget 1.00 GiB, a micro-batch's size not known yet)")
  auto.host_chose(0, 0, "again")  # the same depth: nothing more said
  assert auto.sizer.held(0).reason.startswith("depth 0: the program's ")


class Sending:
  """A StageEngine that records each call's send of a 16 MiB micro-batch as a host's route does
  (what AutoDepth learns a micro-batch's bytes from), stages at once, and trains in a few turns
  of the event loop; it counts the micro-batches it holds staged ahead at once."""

  def __init__(self, recorder):
    self.recorder, self.held, self.most = recorder, set(), 0

  async def stage(self, payload, *, key):
    with self.recorder.span(tracks.ORCHESTRATOR_SEND, "stage_batch", transport="side",
                            bytes=16 * MIB, step=0):
      await asyncio.sleep(0)
    self.held.add(key)
    self.most = max(self.most, len(self.held))
    return contract.staged(key)

  async def train(self, payload, *, stage_key, apply_optimizer):
    self.held.discard(stage_key)  # taken as its call arrives: the ones held are staged ahead
    for _ in range(8):  # a train call outlasts a few stages (turns of the loop, no wall time)
      await asyncio.sleep(0)
    return contract.Trained(payload)

  async def reset(self, keys):
    self.held.difference_update(keys)


def first_step_at_auto(budget):
  telemetry = Telemetry()
  auto = sizing.AutoDepth(budget, telemetry)
  engine = Sending(telemetry.recorder)

  async def job():
    pipeline = StagePipeline(engine, 2, depth_for=auto.depth_for, room=auto.room)
    auto.step_ended(await pipeline.run_step(0, source_of([f"m{i}" for i in range(5)])))

  asyncio.run(job())
  return engine, telemetry.said[-1]


def test_the_first_step_stages_at_the_default_depth_within_a_budget_the_first_send_sizes():
  """Nothing measured yet: depth 2 (the fixed default) where the budget holds two micro-batches;
  where it holds one, the first micro-batch sent sizes it and the step holds one, said so."""
  engine, said = first_step_at_auto(1 << 30)
  assert engine.most == 2 and said[2] == 2
  engine, said = first_step_at_auto(24 * MIB)
  assert engine.most == 1
  assert said[2:] == (1, "depth 1: the budget decided (depth 2 asked: the default (no step "
                      "measured yet)); budget 24.0 MiB, 16.0 MiB used")


def test_a_micro_batch_over_the_budget_holds_the_least_staging_said_once(caplog):
  engine, said = first_step_at_auto(1 * MIB)
  assert engine.most == 1
  assert said[2:] == (1, "depth 1: the budget decided: a micro-batch of 16.0 MiB exceeds it, so "
                      "the least staging that works; budget 1.0 MiB, 16.0 MiB used")
  trainer = Trainer(budget_bytes=1 * MIB)
  assert trainer.run(True, True, True) == 1 and trainer.pool.bound == DEVICE + 1
  assert trainer.reasons[-1] == ("host bound 1: the budget decided: a micro-batch of 16.0 MiB "
                                 "exceeds it, so the least staging that works; budget 1.0 MiB, "
                                 "32.0 MiB used")
  warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
  assert warned == [
      f"tunix-stage: a micro-batch of 16.0 MiB alone exceeds TUNIX_STAGE_MEMORY_BUDGET (1.0 MiB): "
      f"staging holds the least that works ({least}); set TUNIX_STAGE_MEMORY_BUDGET=48MiB or more "
      "to let auto size it" for least in ("depth 1", "host bound 1")]
  # The least a host bound of 1 holds (device + 1 micro-batches) over the budget: said in the
  # line, no warning (one micro-batch fits).
  trainer = Trainer(budget_bytes=24 * MIB)
  assert trainer.run(True, True, True) == 1
  assert trainer.reasons[-1].startswith("host bound 1: the budget decided: 2 micro-batches of "
                                        "16.0 MiB exceed it, so the least staging that works")


class Answering:
  """A StageEngine whose trainer side is a real step aggregator: each step's spans (a receive and
  a placement per micro-batch, its fwd_bwd, then the update that closes the step) recorded as its
  train calls run, and each stage answered with the trainer's newest closed step on it, through
  its wire form, handed to AutoDepth as a host's stage call does."""

  def __init__(self, auto, *, receive_s, compute_s=1.0):
    self.auto, self.receive_s, self.compute_s = auto, receive_s, compute_s
    self.newest = None
    self.recorder = Recorder()
    self.recorder.add_sink(trainer_lib.TrainerSteps(self._closed))
    self.t = 0.0

  def _closed(self, figures):
    self.newest = contract.TrainerStep.of(figures, run="r", max_device_batches=4,
                                         max_host_batches=4, host_sized=False)

  async def stage(self, payload, *, key):
    await asyncio.sleep(0)
    answer = contract.StageOutcome.from_dict(contract.staged(key).carrying(self.newest).as_dict())
    self.auto.answered(answer)
    return answer

  async def train(self, payload, *, stage_key, apply_optimizer):
    t = self.t
    self.recorder.add(tracks.TRAINER_RECEIVE, "stage_batch", t, t + self.receive_s,
                      bytes=MIB, transport="side")
    self.recorder.add(tracks.TRAINER_H2D, "m", t, t + 0.01, bytes=MIB, lane="staging")
    self.recorder.add(tracks.DEVICE_COMPUTE, "fwd_bwd", t, t + self.compute_s, kind="fwd_bwd")
    self.t += self.compute_s
    if apply_optimizer:
      self.recorder.add(tracks.DEVICE_COMPUTE, "update", self.t, self.t + 0.1, kind="update")
      self.t += 0.1
    for _ in range(8):  # a train call outlasts a few stages (turns of the loop, no wall time)
      await asyncio.sleep(0)
    return contract.Trained(payload)

  async def reset(self, keys):
    pass


def test_the_trainer_s_newest_step_rides_on_the_stage_answers_and_sizes_the_depth():
  """No call of its own: the default's depth 2 until a trainer step has closed, then the rule on
  its numbers (a stage of 0.21 s against 1.00 s of compute: one micro-batch staged ahead hides
  it, spikes included)."""
  telemetry = Telemetry()
  auto = sizing.AutoDepth(1 << 30, telemetry)
  engine = Answering(auto, receive_s=0.2)

  async def job():
    async def after_step(step, report):
      telemetry.orchestrator_steps.append(auto.step_ended(report))
    telemetry.orchestrator_steps = []
    await StagePipeline(engine, 2, depth_for=auto.depth_for).run_steps(
        lambda s: source_of([f"s{s}m{i}" for i in range(4)]), steps=5, after_step=after_step)

  asyncio.run(job())
  depths = telemetry.orchestrator_steps
  reasons = [said[3] for said in telemetry.said]
  assert depths[:2] == [2, 2] and depths[2:] == [1, 1, 1], reasons
  assert reasons[0].startswith("depth 2: the default (no step measured yet)")
  assert reasons[-1].startswith("depth 1: a micro-batch's stage 0.21 s against 1.00 s of "
                                "compute, 2x spikes included")
  assert engine.newest.step == 4 and engine.newest.received == 4
  assert engine.newest.fwd_bwd_s == 1.0 and engine.newest.mid_step_wait_s == 0.0


def numbers(step, *, wait_s, busy_s, step_s=100.0, n=10):
  """A trainer step in numbers: `n` micro-batches of 9 s compute in `step_s`, their receives
  `busy_s` in all (the stage path's busier part), the device idle mid-step `wait_s`."""
  return contract.TrainerStep(
      run="r", step=step, step_s=step_s, compute_s=9.0 * n, mid_step_wait_s=wait_s,
      boundary_wait_s=0.0, other_s=0.0, microbatches=n, fwd_bwd_s=9.0, received=n,
      received_s=busy_s, received_bytes=n * MIB, placed=n, placed_s=0.5 * n,
      placed_bytes=n * MIB, staged=n, pool_waits=0, pool_wait_s=0.0, pool_over_bound=0,
      max_device_batches=8, max_host_batches=8, host_sized=False)


def drive(steps, *, filled=True, **trainer):
  """`steps` steps of a Sizer: each step's depth asked as the pipeline asks it, then the
  orchestrator's step (its peak: the depth, or one less where the stages never `filled` it) and
  the trainer's (the same numbers every step)."""
  sizer = sizing.Sizer(budget_bytes=8 * MIB, microbatch_bytes=MIB)
  depths, reasons = [], []
  for step in range(steps):
    depths.append(sizer.depth_for(step, 2))
    reasons.append(sizer.choices[-1].reason)
    peak = depths[-1] if filled or depths[-1] <= 2 else 2
    sizer.orchestrator(sizing.OrchestratorStep(step, depths[-1], peak))
    sizer.trainer(numbers(step, **trainer))
  return depths, reasons


def test_one_more_is_staged_only_where_it_can_remove_a_significant_part_of_the_step():
  """The same 10 s wait in every 100 s step: where the receives took 50 s of it (the stage path
  idle half the step) one more micro-batch staged ahead can remove it, G = min(10, 100 - 50) =
  10 s, at least figures.SHARE of the step: one deeper at a time, each filled in its trial
  steps, up to the budget's 8; where they took 97 s, G = 3 s: the wait is the wire's, and no
  depth holds more."""
  depths, reasons = drive(16, wait_s=10.0, busy_s=50.0)
  assert depths[:2] == [2, 3] and depths[-1] == 8, reasons
  assert all(b - a in (0, 1) for a, b in zip(depths, depths[1:]))
  assert all(depths.count(d) >= sizing.TRIAL for d in range(3, 8))
  assert reasons[1] == ("depth 3: input wait mid-step 10.00 s a step (in 1 of 1 steps); budget "
                        "8.0 MiB, 3.0 MiB used")
  assert reasons[-1].startswith("depth 8: the budget decided (depth 9 asked: input wait ")
  depths, reasons = drive(8, wait_s=10.0, busy_s=97.0)
  assert depths == [2] * 8
  assert reasons[-1].startswith("depth 2: kept: input wait mid-step 10.00 s a step (in 3 of 3 "
                                "steps), 3.00 s of it with the stages idle, too little for one "
                                "more")


def test_a_deeper_depth_the_stages_never_fill_is_given_back_and_not_tried_again_for_a_while():
  """One deeper on the same evidence, but the stages never keep 3 ahead (the orchestrator's peak
  stays 2): back to 2 after its trial steps, 3 a ceiling for CEILING_STEPS trainer steps."""
  depths, reasons = drive(16, filled=False, wait_s=10.0, busy_s=50.0)
  back = depths.index(2, 1)
  assert depths[:back] == [2] + [3] * sizing.TRIAL
  assert reasons[back].startswith(f"depth 2: depth 3 was never filled in {sizing.TRIAL} steps")
  again = depths.index(3, back)
  assert depths[back:again] == [2] * (again - back) and again - back >= sizing.CEILING_STEPS
  assert reasons[again - 1].startswith("depth 2: kept: depth 3 was never filled (input wait ")
