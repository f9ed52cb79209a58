"""Property: whatever the stage latencies, refusals, failures and train failures, every micro-batch
is trained exactly once and in order, the device bound holds and fallbacks are counted exactly.

Drives the real pipeline, store and executor threads (tests/core_engine.py); latencies are real
sleeps in the staging thread and the source (emulated work, never used to order events).
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core_engine import LOST_REPLY, OK, PREPARE_FAILS, ThreadedEngine, TrainFailed, source_of
from tunix_stage_plugin.core.pipeline import StagePipeline


@st.composite
def scenarios(draw):
  steps = draw(st.integers(1, 3))
  sizes = [draw(st.integers(1, 6)) for _ in range(steps)]
  payloads = [[f"s{s}m{i}" for i in range(n)] for s, n in enumerate(sizes)]
  flat = [p for step in payloads for p in step]
  outcomes = {p: draw(st.sampled_from([OK, OK, OK, PREPARE_FAILS, LOST_REPLY])) for p in flat}
  delays = {p: draw(st.sampled_from([0.0, 0.0, 0.0005, 0.002])) for p in flat}
  fail_train = draw(st.one_of(st.none(), st.sampled_from(flat)))
  return dict(
      payloads=payloads, outcomes=outcomes, delays=delays, fail_train=fail_train,
      depth=draw(st.integers(1, 3)), bound=draw(st.integers(1, 3)),
      slot_wait_s=draw(st.sampled_from([0.0, 5.0])), prestage=draw(st.booleans()),
      pull_delay_s=draw(st.sampled_from([0.0, 0.001])),
  )


async def drive(engine: ThreadedEngine, sc: dict) -> list:
  pipeline = StagePipeline(engine, sc["depth"])
  n = len(sc["payloads"])
  sources = [source_of(p, sc["pull_delay_s"]) for p in sc["payloads"]]
  prestaged, reports = None, []
  try:
    for step in range(n):
      def start_next(step=step):
        nonlocal prestaged
        if sc["prestage"] and step + 1 < n:
          prestaged = pipeline.prestage(step + 1, sources[step + 1])
      current, prestaged = prestaged, None
      reports.append(await pipeline.run_step(step, sources[step], prestaged=current,
                                             after_final_dispatch=start_next))
  finally:
    if prestaged is not None:
      await prestaged.discard()
  return reports


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_exactly_once_in_order_bounded_and_counted(sc):
  engine = ThreadedEngine(sc["bound"], stage_outcomes=sc["outcomes"], stage_delay_s=sc["delays"],
                          fail_train={sc["fail_train"]} - {None}, slot_wait_s=sc["slot_wait_s"])
  flat = [p for step in sc["payloads"] for p in step]
  try:
    if sc["fail_train"] is None:
      reports = asyncio.run(drive(engine, sc))
    else:
      with pytest.raises(TrainFailed):
        asyncio.run(drive(engine, sc))
      reports = None
  finally:
    engine.close()

  if sc["fail_train"] is None:
    assert engine.trained == flat  # exactly once, in order
    ends = [sum(len(p) for p in sc["payloads"][:s + 1]) for s in range(len(sc["payloads"]))]
    assert engine.updates == ends  # the optimizer step is each step's last call
    failed = [p for p, outcome in engine.attempts if outcome != OK]
    assert sum(r.fallbacks for r in reports) == len(failed)
    for r, step in zip(reports, sc["payloads"]):
      assert r.trained == r.staged + r.inline == len(step)
      assert r.peak_staged <= sc["depth"]
    # Every batch staged and answered reached training by key; nothing else did.
    assert sum(engine.trained_staged) == sum(r.staged for r in reports) == \
        len([a for a in engine.attempts if a[1] == OK])
  else:
    cut = flat.index(sc["fail_train"])
    assert engine.trained == flat[:cut]  # a prefix, in order, no duplicates; never retried
  assert engine.store.stats.peak <= sc["bound"]
  assert len(engine.store) == 0  # nothing left holding device memory
