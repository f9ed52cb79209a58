"""MethodExecutor: FIFO compute lane, a staging lane that overlaps it, inline light methods."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.core.engines import trainer_executor
from tunix_stage_plugin.core.executor import ExecutorClosedError, Lane, MethodExecutor


def test_lanes():
  ex = trainer_executor()
  assert ex.lane_of("fwd_bwd") is Lane.COMPUTE
  assert ex.lane_of("update") is Lane.COMPUTE
  assert ex.lane_of("prepare_weight_sync") is Lane.COMPUTE
  assert ex.lane_of("some_new_method") is Lane.COMPUTE  # unknown: serialised, as today
  assert ex.lane_of("stage_batch") is Lane.STAGING
  assert ex.lane_of("reset_staged") is Lane.INLINE  # never queued behind a waiting stage
  assert ex.lane_of("heartbeat") is Lane.INLINE and ex.lane_of("info") is Lane.INLINE
  with pytest.raises(ValueError, match="both staging and light"):
    MethodExecutor(staging_methods={"x"}, light_methods={"x"})
  # core names no method: without a host's table every call runs on the compute lane.
  assert MethodExecutor().lane_of("stage_batch") is Lane.COMPUTE


def test_stage_runs_while_compute_is_blocked():
  ex = trainer_executor()
  staged = threading.Event()
  # fwd_bwd only returns once stage_batch has run: on one thread this would time out.
  compute = ex.submit("fwd_bwd", lambda: staged.wait(10))
  stage = ex.submit("stage_batch", staged.set)
  assert stage.result(10) is None and compute.result(10) is True
  ex.close()


def test_compute_lane_is_fifo_and_single_threaded():
  ex = trainer_executor()
  order, threads = [], set()

  def call(i):
    threads.add(threading.current_thread().name)
    order.append(i)

  futures = [ex.submit(name, call, i) for i, name in
             enumerate(["fwd_bwd", "fwd_bwd", "update", "prepare_weight_sync", "compile"] * 20)]
  for f in futures:
    f.result(10)
  assert order == list(range(100)) and len(threads) == 1
  ex.close()


def test_light_methods_run_inline_on_the_caller_thread():
  ex = trainer_executor()
  assert ex.submit("heartbeat", threading.current_thread).result() is threading.current_thread()
  error = ex.submit("info", lambda: 1 / 0).exception()
  assert isinstance(error, ZeroDivisionError)
  ex.close()


def test_async_run_keeps_the_loop_free_for_light_calls():
  ex = trainer_executor()
  release = threading.Event()

  async def scenario():
    compute = asyncio.create_task(ex.run("fwd_bwd", release.wait, 10))
    # Answered at once although fwd_bwd is blocked: the loop never ran it.
    beat = await ex.run("heartbeat", lambda: "alive")
    assert not compute.done()
    staged = await ex.run("stage_batch", lambda: "staged")
    assert not compute.done()
    release.set()
    return beat, staged, await compute

  assert asyncio.run(scenario()) == ("alive", "staged", True)
  ex.close()


def test_close_joins_every_thread_and_is_idempotent():
  before = set(threading.enumerate())
  ex = trainer_executor(name="closetest")
  ex.submit("fwd_bwd", lambda: None).result(10)
  ex.submit("stage_batch", lambda: None).result(10)
  started = [t for t in threading.enumerate() if t.name.startswith("closetest-")]
  assert {t.name.rsplit("_", 1)[0] for t in started} == {"closetest-compute", "closetest-staging"}
  ex.close()
  ex.close()
  assert not any(t.is_alive() for t in started)
  assert set(threading.enumerate()) <= before
  for method in ("fwd_bwd", "stage_batch", "heartbeat"):
    with pytest.raises(ExecutorClosedError):
      ex.submit(method, lambda: None)


def test_close_waits_for_queued_work():
  ex = trainer_executor()
  done = []
  futures = [ex.submit("fwd_bwd", done.append, i) for i in range(20)]
  ex.close()
  assert done == list(range(20)) and all(f.done() for f in futures)


def test_close_with_a_timeout_returns_the_busy_lane_and_abandons_it():
  ex = trainer_executor(name="abandon")
  release, running = threading.Event(), threading.Event()
  held = ex.submit("fwd_bwd", lambda: (running.set(), release.wait(60))[1])
  assert ex.submit("stage_batch", lambda: "staged").result(10) == "staged"
  assert running.wait(10)
  assert ex.close(timeout=0.2) == [Lane.COMPUTE]  # the idle staging lane stopped
  staging = [t for t in threading.enumerate() if t.name.startswith("abandon-staging")]
  assert not staging
  compute = [t for t in threading.enumerate() if t.name.startswith("abandon-compute")]
  assert compute and all(t.daemon for t in compute)  # cannot hold up the interpreter's exit
  release.set()
  assert held.result(10) is True
  for t in compute:
    t.join(10)
    assert not t.is_alive()


def test_close_from_one_of_its_own_lanes_does_not_join_itself():
  ex = trainer_executor(name="selfclose")
  ex.submit("stage_batch", lambda: None).result(10)
  # Today's pool raised "cannot join current thread" here; the lane must close the rest instead.
  assert ex.submit("fwd_bwd", ex.close).result(10) == []
  with pytest.raises(ExecutorClosedError):
    ex.submit("fwd_bwd", lambda: None)
  for t in [t for t in threading.enumerate() if t.name.startswith("selfclose-")]:
    t.join(10)
    assert not t.is_alive(), t.name
  assert ex.close() == []


def test_a_compute_lane_call_is_timed_on_the_lane_unless_its_host_observes_it():
  """The lane's own calls (a weight sync, a checkpoint) are spans of the lane (their queueing not
  counted); fwd_bwd and update, which the host's hooks observe, are not recorded twice."""
  from tunix_stage_plugin.core import tracks  # pylint: disable=import-outside-toplevel
  from tunix_stage_plugin.core.telemetry import recorder as recorder_lib  # pylint: disable=import-outside-toplevel

  class Kept:
    def __init__(self):
      self.spans = []

    def record(self, span):
      self.spans.append(span)

  recorder, kept = recorder_lib.Recorder(), Kept()
  recorder.add_sink(kept)
  ex = trainer_executor(recorder=recorder, observed={"fwd_bwd"})
  gate, entered = threading.Event(), threading.Event()

  def held():
    entered.set()
    assert gate.wait(10)

  async def calls():
    first = asyncio.ensure_future(ex.run("sync_weights", held))
    assert await asyncio.to_thread(entered.wait, 10)
    queued = asyncio.ensure_future(ex.run("save", lambda: "saved"))  # waits behind the first
    await asyncio.sleep(0)
    gate.set()
    return await first, await queued, await ex.run("fwd_bwd", lambda: "trained")

  try:
    assert asyncio.run(calls()) == (None, "saved", "trained")
  finally:
    ex.close()
  assert [(s.track, s.name, dict(s.args)) for s in kept.spans] == [
      (tracks.TRAINER_LANE, "sync_weights", {"method": "sync_weights"}),
      (tracks.TRAINER_LANE, "save", {"method": "save"})]
  # The queued call's span starts on the lane, after the call ahead of it ended.
  assert kept.spans[1].start >= kept.spans[0].end
