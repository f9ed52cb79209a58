"""StagePipeline over real threads and a real event loop (tests/core_engine.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from core_engine import LOST_REPLY, PREPARE_FAILS, ThreadedEngine, TrainFailed, source_of
from tunix_stage_plugin.core.pipeline import MicroBatch, PipelineContractError, StagePipeline


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
    # While train 0 is held, 1 takes the only slot and 2 is refused (no slot wait configured).
    while len(engine.attempts) < 2:
      await asyncio.sleep(0.001)
    hold.set()
    return await task

  report = run(scenario())
  refused = [p for p, outcome in engine.attempts if outcome == "refused"]
  assert engine.attempts[:2] == [(1, "ok"), (2, "refused")]
  assert engine.trained == list(range(6)) and engine.trained_staged[2] is False
  assert report.fallbacks == len(refused) and engine.store.stats.peak == 1
  assert report.fallback_reasons.count("stage refused by the trainer") == len(refused)


def test_failed_and_lost_stages_fall_back_and_leave_nothing_staged(engine_factory):
  engine = engine_factory(1, stage_outcomes={2: PREPARE_FAILS, 4: LOST_REPLY})
  report = run(StagePipeline(engine, 1).run_step(0, source_of(list(range(7)))))
  assert engine.trained == list(range(7)) and engine.updates == [7]
  assert report.fallbacks == 2
  assert any("prepare" not in r and "LostReply" in r for r in report.fallback_reasons)
  # The lost reply's batch was staged on the trainer: it must have been reset, not leaked.
  assert len(engine.store) == 0 and engine.store.stats.dropped == 1
  assert engine.trained_staged[2] is False and engine.trained_staged[4] is False


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
