"""Property: whatever the stage latencies, refusals, failures, train failures and cancellations,
one-call or two-phase stages (placements failing, reset or closed while placing), and whatever
depth and prestage rule the host's seams give each step, every
micro-batch is trained at most once and in order (exactly once when nothing fails), the device
and host bounds hold, fallbacks are counted exactly, and nothing stays staged or running.

Drives the real step loop, store and executor threads (tests/core/engines.py); latencies are real
sleeps in the staging thread and the source (emulated work, never used to order events). A
cancellation is triggered by an event (the k-th stage or train call starting), not by time.
"""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.engines import LOST_REPLY, OK, PREPARE_FAILS, ThreadedEngine, TrainFailed, source_of
from tunix_stage_plugin.core.pipeline import StagePipeline


@st.composite
def scenarios(draw):
  steps = draw(st.integers(1, 3))
  sizes = [draw(st.integers(1, 6)) for _ in range(steps)]
  payloads = [[f"s{s}m{i}" for i in range(n)] for s, n in enumerate(sizes)]
  flat = [p for step in payloads for p in step]
  outcomes = {p: draw(st.sampled_from([OK, OK, OK, PREPARE_FAILS, LOST_REPLY])) for p in flat}
  delays = {p: draw(st.sampled_from([0.0, 0.0, 0.0005, 0.002])) for p in flat}
  fault = draw(st.sampled_from(["none", "none", "train_fails", "train_fails_before_take",
                                "cancel"]))
  return dict(
      payloads=payloads, outcomes=outcomes, delays=delays, fault=fault,
      fail_train=draw(st.sampled_from(flat)),
      cancel_at=draw(st.integers(1, 2 * len(flat))),  # the k-th stage/train event
      depth=draw(st.integers(1, 3)), bound=draw(st.integers(1, 3)),
      slot_wait_s=draw(st.sampled_from([0.0, 5.0])), prestage=draw(st.booleans()),
      host_bound=draw(st.integers(1, 2)),
      pull_delay_s=draw(st.sampled_from([0.0, 0.001])),
      # The host's seams: a depth per step (None: the pipeline's own), and its prestage rule.
      step_depths=draw(st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=steps,
                                                    max_size=steps))),
      prestage_rule=draw(st.sampled_from([None, "odd_only", "never"])),
  )


def depth_of(sc: dict, step: int) -> int:
  return sc["depth"] if sc["step_depths"] is None else sc["step_depths"][step]


class Cancelled(Exception):
  pass


async def drive(engine: ThreadedEngine, sc: dict, armed: dict) -> list:
  depth_for = None if sc["step_depths"] is None else (lambda step, depth: depth_of(sc, step))
  pipeline = StagePipeline(engine, sc["depth"], depth_for=depth_for)
  prestage_next = {None: None, "odd_only": lambda step: step % 2 == 1,
                   "never": lambda step: False}[sc["prestage_rule"]]
  reports = []

  async def after_step(step, report):
    reports.append(report)

  task = asyncio.create_task(pipeline.run_steps(
      lambda step: source_of(sc["payloads"][step], sc["pull_delay_s"]),
      steps=len(sc["payloads"]), prestage=sc["prestage"], prestage_next=prestage_next,
      after_step=after_step))
  armed["loop"], armed["task"] = asyncio.get_running_loop(), task
  try:
    await task
  except asyncio.CancelledError:
    if not task.cancelled():
      raise
    raise Cancelled() from None
  finally:
    # Every task the pipeline started has ended: nothing left running after the step loop.
    # (asyncio finalizes a source generator left open at a step's end in a task of its own.)
    left = {t for t in asyncio.all_tasks() - {asyncio.current_task()}
            if "async_generator" not in repr(t.get_coro())}
    assert not left, left
  return reports


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_exactly_once_in_order_bounded_counted_and_nothing_left(sc):
  armed: dict = {}
  seen = [0]

  def on_event(event):
    if event.startswith(("stage-start", "train")):
      seen[0] += 1
      if sc["fault"] == "cancel" and seen[0] == sc["cancel_at"] and "task" in armed:
        armed["loop"].call_soon_threadsafe(armed["task"].cancel)

  fault = sc["fault"]
  engine = ThreadedEngine(
      sc["bound"], stage_outcomes=sc["outcomes"], stage_delay_s=sc["delays"],
      fail_train={sc["fail_train"]} if fault == "train_fails" else set(),
      fail_train_before_take={sc["fail_train"]} if fault == "train_fails_before_take" else set(),
      slot_wait_s=sc["slot_wait_s"], on_event=on_event, max_host_batches=sc["host_bound"])
  flat = [p for step in sc["payloads"] for p in step]
  reports, error = None, None
  try:
    reports = asyncio.run(drive(engine, sc, armed))
  except (TrainFailed, Cancelled) as e:
    error = e
  finally:
    engine.close()

  if fault in ("none",) or (fault == "cancel" and error is None):
    assert error is None
    assert engine.trained == flat  # exactly once, in order
    ends = [sum(len(p) for p in sc["payloads"][:s + 1]) for s in range(len(sc["payloads"]))]
    assert engine.updates == ends  # the optimizer step is each step's last call
    # Not staged, refused, failed, lost, or received but never placed.
    failed = [p for p, outcome in engine.attempts if outcome != OK]
    assert sum(r.fallbacks for r in reports) == len(failed)
    unplaced = sum(outcome == "unplaced" for _, outcome in engine.attempts)
    for n, (r, step) in enumerate(zip(reports, sc["payloads"])):
      assert r.trained == r.staged + r.inline == len(step)
      assert r.peak_staged <= depth_of(sc, n)  # the host's depth for the step bounds it
      assert r.prestaged <= r.staged
      if sc["prestage_rule"] == "never" or (sc["prestage_rule"] == "odd_only" and n % 2 == 0):
        assert r.prestaged == 0
    # Every batch staged and answered reached training by key; nothing else did.
    assert sum(engine.trained_staged) == sum(r.staged for r in reports) == \
        len([a for a in engine.attempts if a[1] == OK]) - unplaced
  elif fault.startswith("train_fails"):
    assert isinstance(error, TrainFailed)
    cut = flat.index(sc["fail_train"])
    assert engine.trained == flat[:cut]  # a prefix, in order, no duplicates; never retried
  else:  # cancelled part-way: what was trained is a prefix, in order, no duplicates
    assert isinstance(error, Cancelled)
    assert engine.trained == flat[:len(engine.trained)]
  assert engine.store.stats.peak <= sc["bound"]
  assert engine.store.stats.peak_host <= sc["host_bound"]
  assert len(engine.store) == 0, engine.store.keys()  # nothing left holding device memory
