"""StagePipeline over real threads and a real event loop (tests/core/engines.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.core.engines import LOST_REPLY, PREPARE_FAILS, UNREADABLE, ThreadedEngine, TrainFailed
from tests.core.engines import source_of
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core.pipeline import MicroBatch, PipelineContractError, StagePipeline
from tunix_stage_plugin.core.contract import StageKeyError


def run(coro):
  return asyncio.run(coro)


@pytest.fixture
def engine_factory():
  engines = []

  def make(*args, **kwargs):
    engines.append(ThreadedEngine(*args, **kwargs))
    return engines[-1]

  yield make
  for e in engines:
    e.close()


@pytest.mark.parametrize("depth,bound", [(1, 1), (2, 2), (3, 3)])
def test_trains_every_micro_batch_once_in_order_mostly_staged(engine_factory, depth, bound):
  engine = engine_factory(bound)
  pipeline = StagePipeline(engine, depth)
  report = run(pipeline.run_step(0, source_of(list(range(8)))))
  assert engine.trained == list(range(8)) and engine.updates == [8]
  assert report.trained == 8 and report.staged + report.inline == 8
  assert report.fallbacks == 0 and report.result == 8
  # Only the first micro-batch has nothing pending to hide behind.
  assert engine.trained_staged[0] is False and report.staged >= 1
  assert report.peak_staged <= depth and engine.store.stats.peak <= bound
  assert len(engine.store) == 0


def test_depth_over_the_device_bound_falls_back_and_counts(engine_factory):
  hold = threading.Event()
  engine = engine_factory(1, train_gate={0: hold}, slot_wait_s=0)

  async def scenario():
    task = asyncio.create_task(StagePipeline(engine, 3).run_step(0, source_of(list(range(6)))))
    # While train 0 is held, 1 is received (the only host buffer) and takes the only device slot;
    # 2 finds the host buffer still held (refused), or, once 1 is being placed, is received and
    # finds no device slot (no slot wait configured): it trains from its payload either way.
    while len(engine.attempts) < 2:
      await asyncio.sleep(0.001)
    hold.set()
    return await task

  report = run(scenario())
  refused = [p for p, outcome in engine.attempts if outcome == "refused"]
  # Received, but its placement found the device bound full: trained from its payload.
  unplaced = [p for p, outcome in engine.attempts if outcome == "unplaced"]
  assert engine.attempts[0] == (1, "ok") and engine.attempts[1][0] == 2
  assert engine.trained == list(range(6)) and engine.trained_staged[2] is False
  assert refused and 2 in refused + unplaced
  assert report.fallbacks == len(refused) + len(unplaced) and engine.store.stats.peak == 1
  assert sum(r.startswith("refused: host bound reached") for r in report.fallback_reasons) \
      == len(refused)
  assert sum(r.startswith("unplaced: device bound reached") for r in report.fallback_reasons) \
      == len(unplaced)


def test_failed_and_lost_stages_fall_back_and_leave_nothing_staged(engine_factory):
  engine = engine_factory(1, stage_outcomes={2: PREPARE_FAILS, 4: LOST_REPLY})
  report = run(StagePipeline(engine, 1).run_step(0, source_of(list(range(7)))))
  assert engine.trained == list(range(7)) and engine.updates == [7]
  assert report.fallbacks == 2
  assert any("prepare" not in r and "LostReply" in r for r in report.fallback_reasons)
  # The lost reply's batch was staged on the trainer: it must have been reset, not leaked.
  assert len(engine.store) == 0 and engine.store.stats.dropped == 1
  assert engine.trained_staged[2] is False and engine.trained_staged[4] is False


@pytest.mark.parametrize("unreadable", [{2}, {3, 5}])
def test_an_unreadable_staged_payload_is_trained_inline_once_and_counted(engine_factory,
                                                                           unreadable):
  """5 closes the step: its inline retry must still apply the optimizer."""
  engine = engine_factory(2, stage_outcomes={p: UNREADABLE for p in unreadable})
  pipeline = StagePipeline(engine, 2)
  report = run(pipeline.run_step(0, source_of(list(range(6)))))
  assert engine.trained == list(range(6)) and engine.updates == [6]
  assert sorted(p for p, a in engine.attempts if a == UNREADABLE) == sorted(unreadable)
  assert [engine.trained_staged[p] for p in sorted(unreadable)] == [False] * len(unreadable)
  assert report.fallbacks == len(unreadable) and report.inline >= len(unreadable)
  assert all(r.startswith("unplaced: staged payload unreadable:")
             for r in report.fallback_reasons), report.fallback_reasons
  assert len(engine.store) == 0 and report.trained == 6


def test_an_unreadable_answer_to_an_inline_train_is_not_retried(engine_factory):
  """Only a train by key can be unreadable; from an inline train it is a broken contract."""

  class Confused(ThreadedEngine):
    async def train(self, payload, *, stage_key, apply_optimizer):
      if stage_key is None:
        raise contract.StagedPayloadUnreadable("nothing was staged")
      return await super().train(payload, stage_key=stage_key, apply_optimizer=apply_optimizer)

  engine = Confused(1)
  try:
    with pytest.raises(contract.StagedPayloadUnreadable):
      run(StagePipeline(engine, 1).run_step(0, source_of(list(range(3)))))
    assert engine.trained == [] and len(engine.store) == 0
  finally:
    engine.close()


def test_next_micro_batch_dispatches_while_a_later_stage_is_still_in_flight(engine_factory):
  gate = threading.Event()
  engine = engine_factory(2, stage_gate={2: gate})

  async def scenario():
    pipeline = StagePipeline(engine, 2)
    task = asyncio.create_task(pipeline.run_step(0, source_of([0, 1, 2])))
    # Train 1 must not wait for stage 2: poll the engine log (no sleep-based ordering).
    while "train 1" not in engine.events:
      await asyncio.sleep(0.001)
    assert "stage-end 2" not in engine.events
    gate.set()
    return await task

  run(scenario())
  assert engine.trained == [0, 1, 2] and engine.trained_staged[2] is True


def test_train_failure_propagates_trains_nothing_after_and_resets_staged(engine_factory):
  engine = engine_factory(2, fail_train={3})
  with pytest.raises(TrainFailed):
    run(StagePipeline(engine, 2).run_step(0, source_of(list(range(8)))))
  assert engine.trained == [0, 1, 2] and engine.updates == []
  assert len(engine.store) == 0


def test_source_failure_lets_the_pending_train_finish_and_resets(engine_factory):
  engine = engine_factory(2)

  async def broken_source():
    yield MicroBatch(0)
    yield MicroBatch(1)
    raise OSError("rollout queue closed")

  with pytest.raises(OSError, match="rollout queue closed"):
    run(StagePipeline(engine, 2).run_step(0, broken_source()))
  assert engine.trained == [0, 1] and len(engine.store) == 0


def test_source_without_a_closing_micro_batch_is_a_contract_error(engine_factory):
  engine = engine_factory(1)

  async def endless_step():
    for i in range(3):
      yield MicroBatch(i)

  with pytest.raises(PipelineContractError, match="without one marked closes_step=True"):
    run(StagePipeline(engine, 1).run_step(0, endless_step()))
  assert engine.updates == [] and len(engine.store) == 0


@pytest.mark.parametrize("count", [0, 3])
def test_an_open_ended_step_ends_after_what_its_source_gave(engine_factory, count):
  """tunix's seam: a step whose scored queue answers no more groups ends without an update; the
  step's result is its last train call's (None without one), and nothing stays staged."""
  engine = engine_factory(2)

  async def short_step():
    for i in range(count):
      yield MicroBatch(i)

  report = run(StagePipeline(engine, 2, open_ended=True).run_step(0, short_step()))
  assert engine.trained == list(range(count)) and engine.updates == []
  assert report.trained == count and report.staged + report.inline == count
  assert report.result == (None if count == 0 else count)  # the engine answers len(trained)
  assert len(engine.store) == 0


def test_an_open_ended_pipeline_still_trains_a_closing_micro_batch_last(engine_factory):
  engine = engine_factory(2)
  report = run(StagePipeline(engine, 2, open_ended=True).run_step(0, source_of(list(range(5)))))
  assert engine.trained == list(range(5)) and engine.updates == [5] and report.result == 5


def test_source_yielding_a_non_micro_batch_is_a_contract_error(engine_factory):
  async def raw():
    yield {"tokens": [1]}

  with pytest.raises(PipelineContractError, match="yielded dict; accepted: MicroBatch"):
    run(StagePipeline(engine_factory(1), 1).run_step(0, raw()))


def test_prestage_stages_the_next_steps_head_during_the_boundary(engine_factory):
  engine = engine_factory(2)

  async def scenario():
    pipeline = StagePipeline(engine, 2)
    sources = [source_of([f"s{s}m{i}" for i in range(4)]) for s in range(3)]
    prestaged, reports = None, []
    for step in range(3):
      def start_next(step=step):
        nonlocal prestaged
        if step + 1 < 3:
          prestaged = pipeline.prestage(step + 1, sources[step + 1])
      current, prestaged = prestaged, None
      reports.append(await pipeline.run_step(step, sources[step], prestaged=current,
                                             after_final_dispatch=start_next))
    return reports

  reports = run(scenario())
  assert engine.trained == [f"s{s}m{i}" for s in range(3) for i in range(4)]
  assert engine.updates == [4, 8, 12]
  assert reports[0].prestaged == 0
  # With the boundary prestage, later steps start with staged micro-batches, the first included.
  assert reports[1].prestaged >= 1 and reports[2].prestaged >= 1
  assert engine.store.stats.peak <= 2 and len(engine.store) == 0


def test_prestage_never_stages_the_micro_batch_that_closes_its_step(engine_factory):
  engine = engine_factory(2)

  async def scenario():
    pipeline = StagePipeline(engine, 2)
    source = source_of(["only"])  # a one-micro-batch step: its head closes it
    prestage = pipeline.prestage(1, source)
    report = await pipeline.run_step(1, source, prestaged=prestage)
    return report

  report = run(scenario())
  assert engine.attempts == [] and engine.trained == ["only"] and report.inline == 1


def test_prestage_for_another_step_or_source_is_refused(engine_factory):
  engine = engine_factory(1)

  async def scenario():
    pipeline = StagePipeline(engine, 1)
    source = source_of([1, 2])
    prestage = pipeline.prestage(1, source)
    with pytest.raises(PipelineContractError, match="made for step 1"):
      await pipeline.run_step(2, source, prestaged=prestage)
    await prestage.discard()

  run(scenario())
  assert engine.trained == [] and len(engine.store) == 0


def test_discarded_prestage_resets_what_it_staged(engine_factory):
  engine = engine_factory(2)

  async def scenario():
    pipeline = StagePipeline(engine, 2)
    prestage = pipeline.prestage(5, source_of([1, 2, 3]))
    while len([a for a in engine.attempts if a[1] == "ok"]) < 2:
      await asyncio.sleep(0.001)
    await prestage.discard()

  run(scenario())
  assert engine.store.stats.staged == 2 and len(engine.store) == 0


def test_metrics_names():
  from tunix_stage_plugin.core.pipeline import StepReport
  assert set(StepReport(0).metrics()) == {"stage/fallbacks", "stage/staged", "stage/inline",
                                         "stage/prestaged", "stage/peak_staged"}


def test_depth_must_be_a_positive_int(engine_factory):
  with pytest.raises(ValueError, match="TUNIX_MAX_STAGED_BATCHES"):
    StagePipeline(engine_factory(1), 0)


# --- every staged key released on every path, typed outcomes, the step loop ------------------


def test_a_train_failing_before_the_trainer_took_its_key_resets_that_key(engine_factory):
  engine = engine_factory(2, fail_train_before_take={1})
  with pytest.raises(TrainFailed, match="before take for 1"):
    run(StagePipeline(engine, 2).run_step(0, source_of(list(range(4)))))
  assert engine.trained == [0] and engine.trained_staged[1:] == []
  assert len(engine.store) == 0, engine.store.keys()  # 1 was staged and is not left behind


def test_cancel_while_adopting_a_prestage_resets_what_it_staged(engine_factory):
  gate = threading.Event()
  engine = engine_factory(2, stage_gate={"s1m0": gate})

  async def scenario():
    pipeline = StagePipeline(engine, 2)
    loop_task = None

    async def after_step(step, report):
      # Step 1's head is being staged (held at the gate): cancel as step 1 starts adopting it.
      loop_task.cancel()

    loop_task = asyncio.create_task(pipeline.run_steps(
        lambda step: source_of([f"s{step}m{i}" for i in range(3)]), steps=2,
        after_step=after_step))
    with pytest.raises(asyncio.CancelledError):
      await loop_task
    return pipeline

  run(scenario())
  gate.set()  # the stage held on the trainer finishes after the reset: it must not hold a slot
  engine.executor.close()
  assert engine.trained == ["s0m0", "s0m1", "s0m2"]
  assert len(engine.store) == 0, engine.store.keys()


def test_a_lost_reset_is_retried_before_the_next_step(engine_factory):
  staged_1 = threading.Event()  # train 0 runs until the stage of 1 has ended (so 1 is offered)
  engine = engine_factory(2, stage_outcomes={1: LOST_REPLY}, train_gate={0: staged_1},
                          on_event=lambda e: e == "stage-end 1" and staged_1.set())
  real_reset, calls = engine.reset, []

  async def flaky_reset(keys):
    calls.append(list(keys))
    if len(calls) == 1:
      raise ConnectionError("reset reply lost")
    await real_reset(keys)

  engine.reset = flaky_reset
  pipeline = StagePipeline(engine, 1)
  run(pipeline.run_step(0, source_of([0, 1, 2])))
  assert len(calls) == 1 and pipeline.pending_resets == calls[0]
  assert len(engine.store) == 1  # the lost stage still holds its slot until the retry
  run(pipeline.run_step(1, source_of([3, 4])))
  assert calls[1] == calls[0] and pipeline.pending_resets == []
  assert len(engine.store) == 0 and engine.trained == [0, 1, 2, 3, 4]


def test_the_cleanup_resets_run_together(engine_factory):
  """A failed stage's own reset and the aborted step's reset of what it staged run at once, so a
  trainer that does not answer costs the cleanup one reset's timeout, not one per reset. Each
  reset here waits (bounded) for the other to start; run one after the other, the first times out
  and is kept for a retry."""
  orphan_started = threading.Event()  # train 0 fails only once the failed stage's reset began
  engine = engine_factory(2, stage_outcomes={2: LOST_REPLY}, train_gate={0: orphan_started},
                          fail_train={0})
  real_reset, active, peak, resets = engine.reset, [0], [0], []
  both = asyncio.Event()

  async def reset(keys):
    resets.append(sorted(engine.key_payload[k] for k in keys))
    active[0] += 1
    peak[0] = max(peak[0], active[0])
    if active[0] == 2:
      both.set()
    if 2 in resets[-1]:
      orphan_started.set()
    try:
      await asyncio.wait_for(both.wait(), 10)
      await real_reset(keys)
    finally:
      active[0] -= 1

  engine.reset = reset
  pipeline = StagePipeline(engine, 2)
  with pytest.raises(TrainFailed):
    run(pipeline.run_step(0, source_of([0, 1, 2, 3])))
  assert peak[0] == 2 and sorted(resets) == [[1], [2]], resets
  assert pipeline.pending_resets == [] and len(engine.store) == 0


class _Unsupported:
  """An engine whose trainer cannot stage at all (as a trainer without the plugin answers)."""

  def __init__(self):
    self.staged_offers, self.trained = 0, []
    self.offered = asyncio.Event()

  async def stage(self, payload, *, key):
    self.staged_offers += 1
    self.offered.set()
    return contract.unsupported(key, "no stage_batch on this trainer")

  async def train(self, payload, *, stage_key, apply_optimizer):
    await self.offered.wait()  # the first train call runs until a stage was offered
    self.trained.append(payload)
    return contract.Trained(None)

  async def reset(self, keys):
    raise AssertionError("nothing was staged: nothing to reset")


def test_a_trainer_that_cannot_stage_is_asked_once(caplog):
  engine = _Unsupported()
  reports = []

  async def after_step(step, report):
    reports.append(report)

  with caplog.at_level("WARNING", logger="tunix_stage_plugin"):
    run(StagePipeline(engine, 2).run_steps(lambda s: source_of([f"s{s}m{i}" for i in range(4)]),
                                           steps=3, after_step=after_step))
  assert engine.staged_offers == 1 and len(engine.trained) == 12
  assert [r.fallbacks for r in reports] == [1, 0, 0] and all(r.staged == 0 for r in reports)
  assert sum("cannot stage" in r.message for r in caplog.records) == 1


def test_a_malformed_key_from_the_engine_ends_the_step(engine_factory):
  class Malformed(ThreadedEngine):
    async def stage(self, payload, *, key):
      return await super().stage(payload, key="bad key")

  first_offered = threading.Event()
  engine = Malformed(4, train_gate={0: first_offered},
                     on_event=lambda e: e.startswith("stage-start") and first_offered.set())
  try:
    with pytest.raises(StageKeyError, match=r"\[A-Za-z0-9._:-\]"):
      run(StagePipeline(engine, 2).run_step(0, source_of(list(range(5)))))
  finally:
    engine.close()
  assert len(engine.store) == 0


@pytest.mark.parametrize("prefix", ["a b", "k/1", "x" * 97, 7])
def test_an_invalid_key_prefix_is_refused_up_front(engine_factory, prefix):
  with pytest.raises((ValueError, StageKeyError), match=r"\[A-Za-z0-9._:-\]"):
    StagePipeline(engine_factory(1), 2, key_prefix=prefix)


def test_prestaged_counts_only_stages_started_during_the_boundary(engine_factory):
  # Depth 1: during the boundary only s1m0 can be staged; s1m1 is pulled but staged in step 1.
  engine = engine_factory(3)
  reports = []

  async def after_step(step, report):
    reports.append(report)

  run(StagePipeline(engine, 1).run_steps(
      lambda s: source_of([f"s{s}m{i}" for i in range(3)]), steps=2, after_step=after_step))
  assert engine.trained == ["s0m0", "s0m1", "s0m2", "s1m0", "s1m1", "s1m2"]
  assert reports[1].prestaged == 1 and reports[1].staged >= 2


def test_the_hosts_depth_is_asked_once_per_step_and_bounds_what_is_staged(engine_factory):
  """`depth_for` (tunix: StandardRLProgram._stage_ahead_while_pending): depth 1 in step 0, none
  in step 1 (it trains inline, and nothing of it is staged during the boundary before it), 3 in
  step 2; the pipeline's own depth is 2."""
  engine = engine_factory(3)
  asked, reports = [], []

  def depth_for(step, depth):
    asked.append((step, depth))
    return {0: 1, 1: 0, 2: 3}[step]

  async def after_step(step, report):
    reports.append(report)

  run(StagePipeline(engine, 2, depth_for=depth_for).run_steps(
      lambda s: source_of([f"s{s}m{i}" for i in range(4)]), steps=3, after_step=after_step))
  assert engine.trained == [f"s{s}m{i}" for s in range(3) for i in range(4)]
  assert engine.updates == [4, 8, 12]
  assert asked == [(0, 2), (1, 2), (2, 2)]  # once per step, when its staging starts
  assert [r.peak_staged <= d for r, d in zip(reports, (1, 0, 3))] == [True] * 3
  assert not any(e.startswith("stage-start s1") for e in engine.events)  # step 1: none staged
  assert reports[1].staged == reports[1].prestaged == 0 and reports[1].inline == 4
  assert all(r.fallbacks == 0 and r.staged + r.inline == 4 for r in reports)
  assert len(engine.store) == 0


def test_the_hosts_prestage_rule_is_asked_at_each_boundary_with_a_next_step(engine_factory):
  """`prestage_next` (tunix: StandardRLProgram._prestage_across_boundary) saying no: nothing is
  staged during any boundary; it is asked once per boundary that has a next step."""
  engine = engine_factory(2)
  asked, reports = [], []

  async def after_step(step, report):
    reports.append(report)

  def no(next_step):
    asked.append(next_step)
    return False

  run(StagePipeline(engine, 2).run_steps(lambda s: source_of([f"s{s}m{i}" for i in range(3)]),
                                         steps=3, prestage_next=no, after_step=after_step))
  assert engine.trained == [f"s{s}m{i}" for s in range(3) for i in range(3)]
  assert asked == [1, 2]
  assert [r.prestaged for r in reports] == [0, 0, 0]
  # Each step's head was dispatched with nothing pending before it: inline, never staged.
  assert not any(e.startswith(("stage-start s1m0", "stage-start s2m0")) for e in engine.events)


@pytest.mark.parametrize("hook,answer,match", [
    ("depth_for", -1, r"depth_for\(0, 2\) returned -1; accepted: an int >= 0"),
    ("depth_for", True, r"depth_for\(0, 2\) returned True; accepted: an int >= 0"),
    ("prestage_next", 1, r"prestage_next\(1\) returned 1; accepted: a bool"),
])
def test_a_hook_answering_outside_its_type_is_a_contract_error(engine_factory, hook, answer,
                                                               match):
  engine = engine_factory(2)
  pipeline = StagePipeline(engine, 2, **({"depth_for": lambda s, d: answer}
                                         if hook == "depth_for" else {}))
  kwargs = {"prestage_next": lambda n: answer} if hook == "prestage_next" else {}
  with pytest.raises(PipelineContractError, match=match):
    run(pipeline.run_steps(lambda s: source_of([f"s{s}m{i}" for i in range(3)]), steps=2,
                           **kwargs))
  assert len(engine.store) == 0  # whatever the first step staged was reset
