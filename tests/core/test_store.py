"""StagedBatchStore: keyed, bounded, consumed once, clear errors, safe under concurrency."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core.outcome import StageStatus
from tests.core.engines import trainer_executor
from tunix_stage_plugin.core.store import PlacementFailed, StagedBatchStore, StageKeyError


def place(payload):
  return ("placed", payload)


def test_stage_then_take_once():
  store = StagedBatchStore(1)
  result = store.stage("k1", 7, place)
  assert result.staged and result.reason is None
  assert store.take("k1") == ("placed", 7)
  with pytest.raises(StageKeyError, match="'k1' is not staged"):
    store.take("k1")
  assert len(store) == 0 and store.stats.consumed == 1


@pytest.mark.parametrize("key,fragment", [
    (7, "got int 7"), (None, "got NoneType"), (b"k", "got bytes"),
    ("", "length 0"), ("x" * 129, "length 129"), ("a b", "'a b'"), ("k/1", "'k/1'"),
    ("ключ", "'ключ'"),
])
def test_malformed_keys_are_rejected_with_the_rule(key, fragment):
  store = StagedBatchStore(1)
  for call in (lambda: store.stage(key, 1, place), lambda: store.take(key),
               lambda: store.reset([key])):
    with pytest.raises(StageKeyError) as e:
      call()
    assert fragment in str(e.value) and "[A-Za-z0-9._:-]" in str(e.value)


def test_longest_allowed_key_is_accepted():
  assert StagedBatchStore(1).stage("k" * 128, 1, place).staged


def test_duplicate_key_is_an_error_and_keeps_the_first():
  store = StagedBatchStore(2)
  store.stage("k", 1, place)
  with pytest.raises(StageKeyError, match="already used; keys are single-use"):
    store.stage("k", 2, place)
  assert store.take("k") == ("placed", 1)


def test_over_the_bound_refuses_with_reason_and_never_evicts():
  store = StagedBatchStore(2, slot_wait_s=0)
  assert store.stage("a", 1, place).staged and store.stage("b", 2, place).staged
  refused = store.stage("c", 3, place)
  assert not refused.staged and "device bound reached: 2 of 2 staged batches held for 0" in \
      refused.reason
  assert "TUNIX_STAGE_MAX_DEVICE_BATCHES" in refused.reason
  assert store.keys() == ["a", "b"] and store.stats.refused == 1
  store.take("a")
  assert store.stage("c2", 3, place).staged  # room again once one is consumed


def test_prepare_failure_is_reported_and_frees_the_slot():
  store = StagedBatchStore(1)

  def broken(payload):
    raise ValueError("bad shape")

  result = store.stage("a", 1, broken)
  assert not result.staged and result.reason == "prepare failed: ValueError: bad shape"
  assert store.stage("b", 2, place).staged and store.stats.failed == 1


def test_reset_some_or_all():
  store = StagedBatchStore(3)
  for k in "abc":
    store.stage(k, k, place)
  assert store.reset(["b", "zz"]) == ["b"]  # unknown keys are simply not there to drop
  assert store.keys() == ["a", "c"]
  assert sorted(store.reset()) == ["a", "c"] and len(store) == 0


def test_reset_while_placing_keeps_the_slot_until_placement_ends():
  store = StagedBatchStore(1, slot_wait_s=0)
  entered, release = threading.Event(), threading.Event()

  def slow(payload):
    entered.set()
    assert release.wait(10)
    return payload

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    future = pool.submit(store.stage, "a", 1, slow)
    assert entered.wait(10)
    assert store.reset() == ["a"]
    # The buffers being placed still exist: a new stage must not exceed the bound.
    assert not store.stage("b", 2, place).staged
    release.set()
    result = future.result(10)
  assert not result.staged and result.reason == "reset while staging"
  assert store.stage("c", 2, place).staged and store.keys() == ["c"]


def test_take_waits_for_a_batch_still_being_placed():
  store = StagedBatchStore(1)
  entered, release = threading.Event(), threading.Event()

  def slow(payload):
    entered.set()
    assert release.wait(10)
    return ("placed", payload)

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    staged = pool.submit(store.stage, "a", 1, slow)
    assert entered.wait(10)
    taken = pool.submit(store.take, "a")
    assert not taken.done()
    release.set()
    assert taken.result(10) == ("placed", 1) and staged.result(10).staged


def test_take_of_a_failed_placement_names_the_failure():
  store = StagedBatchStore(1)
  entered, release = threading.Event(), threading.Event()

  def failing(payload):
    entered.set()
    assert release.wait(10)
    raise OSError("transfer aborted")

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    pool.submit(store.stage, "a", 1, failing)
    assert entered.wait(10)
    taken = pool.submit(store.take, "a")
    release.set()
    with pytest.raises(StageKeyError, match="OSError: transfer aborted"):
      taken.result(10)


def test_take_times_out_instead_of_blocking_forever():
  store = StagedBatchStore(1)
  entered, release = threading.Event(), threading.Event()

  def stuck(payload):
    entered.set()
    release.wait(10)
    return payload

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pool.submit(store.stage, "a", 1, stuck)
    assert entered.wait(10)
    with pytest.raises(TimeoutError, match="still being placed"):
      store.take("a", timeout=0.01)
    release.set()


@pytest.mark.parametrize("slot_wait_s", [0, 10])
def test_concurrent_stagers_never_exceed_the_bound(slot_wait_s):
  bound, live, peak = 3, [0], [0]
  lock = threading.Lock()
  store = StagedBatchStore(bound, slot_wait_s=slot_wait_s)

  def counting(payload):
    with lock:
      live[0] += 1
      peak[0] = max(peak[0], live[0])
    return payload

  def worker(i):
    outcomes = []
    for j in range(200):
      key = f"w{i}-{j}"
      if store.stage(key, key, counting).staged:
        # Taken and uncounted under one lock: the stage the take lets in counts only after this
        # (else a fast stager's prepare lands between the two and counts bound + 1).
        with lock:
          outcomes.append(store.take(key) == key)
          live[0] -= 1
    return outcomes

  with concurrent.futures.ThreadPoolExecutor(6) as pool:
    results = [r for f in [pool.submit(worker, i) for i in range(6)] for r in f.result(60)]
  assert all(results) and len(results) == store.stats.consumed
  assert peak[0] <= bound and store.stats.peak <= bound and len(store) == 0
  assert store.stats.staged + store.stats.refused == 6 * 200
  if slot_wait_s:  # every holder releases its slot promptly: waiting stages always get one
    assert store.stats.refused == 0 and store.stats.staged == 6 * 200


def test_a_full_store_waits_for_the_slot_a_take_frees():
  store = StagedBatchStore(1, slot_wait_s=30)
  store.stage("a", 1, place)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    waiting = pool.submit(store.stage, "b", 2, place)
    # The stage of b arrived before fwd_bwd took a out of its slot (the race a bound of 1 has).
    assert store.take("a") == ("placed", 1)
    assert waiting.result(10).staged
  assert store.keys() == ["b"] and store.stats.slot_waits == 1


def test_a_full_store_refuses_after_its_slot_wait():
  store = StagedBatchStore(1, slot_wait_s=0.05)
  store.stage("a", 1, place)
  refused = store.stage("b", 2, place)  # nobody takes a: bounded wait, then a reason
  assert not refused.staged and "held for 0.05 s" in refused.reason and store.keys() == ["a"]


def test_reset_refuses_a_stage_waiting_for_a_slot():
  store = StagedBatchStore(1, slot_wait_s=30)
  store.stage("a", 1, place)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    waiting = pool.submit(store.stage, "b", 2, place)
    while not store.stats.slot_waits:  # b is registered as waiting under the lock
      threading.Event().wait(0.001)
    assert store.reset(["b"]) == []
    result = waiting.result(10)
  assert not result.staged and result.reason == "reset while waiting for a device slot"
  assert store.keys() == ["a"]


def test_a_stage_overtaken_by_its_reset_is_refused():
  store = StagedBatchStore(1)
  assert store.reset(["late"]) == []
  result = store.stage("late", 1, place)
  assert not result.staged and result.reason == "reset before it was staged" and len(store) == 0
  assert store.stage("other", 2, place).staged


def test_bound_must_be_a_positive_int():
  for bad in (0, -1, 1.5, "2"):
    with pytest.raises(ValueError, match="max_device_batches must be an int >= 1"):
      StagedBatchStore(bad)


def test_reset_of_a_single_str_is_refused_not_iterated():
  store = StagedBatchStore(2)
  store.stage("ab", 1, place)
  with pytest.raises(TypeError, match=r"got str 'ab' \(for one key, pass \['ab'\]\)"):
    store.reset("ab")
  assert store.keys() == ["ab"]
  assert store.stage("a", 2, place).staged  # no tombstone was left for 'a' or 'b'


@pytest.mark.parametrize("finish", ["take", "reset", "refused", "failed"])
def test_a_used_key_cannot_be_staged_again(finish):
  store = StagedBatchStore(1, slot_wait_s=0)
  if finish == "refused":
    store.stage("other", 0, place)
    assert not store.stage("k", 1, place).staged
  elif finish == "failed":
    assert not store.stage("k", 1, lambda p: 1 / 0).staged
  else:
    store.stage("k", 1, place)
    getattr(store, finish)(*(["k"] if finish == "take" else [["k"]]))
  with pytest.raises(StageKeyError, match="'k' was already used; keys are single-use"):
    store.stage("k", 2, place)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_inside_prepare_frees_the_slot_and_propagates(interrupt):
  store = StagedBatchStore(1, slot_wait_s=0)

  def interrupted(payload):
    raise interrupt()

  with pytest.raises(interrupt):
    store.stage("a", 1, interrupted)
  assert len(store) == 0 and store.stage("b", 2, place).staged


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, "5", True])
def test_slot_wait_must_be_a_finite_number(value):
  with pytest.raises(ValueError, match="slot_wait_s must be a finite number of seconds >= 0"):
    StagedBatchStore(1, slot_wait_s=value)


def test_an_unstageable_payload_is_refused_before_waiting_for_a_slot():
  store = StagedBatchStore(1, slot_wait_s=3600)  # a wait would hang this test
  store.stage("a", 1, place)

  def check(payload):
    raise TypeError("a TrainerPayload is not a JAX pytree")

  result = store.stage("b", "not an array", place, check=check)
  assert result.status is StageStatus.REFUSED
  assert result.reason == "not stageable: TypeError: a TrainerPayload is not a JAX pytree"
  assert store.keys() == ["a"] and store.stats.slot_waits == 0


def test_a_reset_during_the_check_refuses_the_stage():
  store = StagedBatchStore(1)
  entered, release = threading.Event(), threading.Event()

  def check(payload):
    entered.set()
    assert release.wait(10)

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    future = pool.submit(store.stage, "a", 1, place, check=check)
    assert entered.wait(10)
    assert store.reset(["a"]) == []
    release.set()
    result = future.result(10)
  assert result.status is StageStatus.REFUSED and len(store) == 0


# --- two phases: receive now, place next (the `defer` path) ----------------------------------


class Jobs:
  """A staging lane run by hand: `defer` queues the placement, `run_next` runs it here."""

  def __init__(self):
    self.queue = []

  def __call__(self, job):
    self.queue.append(job)

  def run_next(self):
    self.queue.pop(0)()


def test_a_split_stage_answers_once_received_and_places_later():
  store, jobs = StagedBatchStore(1, max_host_batches=1), Jobs()
  assert store.stage("a", 1, place, defer=jobs).staged and len(jobs.queue) == 1
  assert store.stats.staged == 0 and store.stats.peak_host == 1  # received, not yet placed
  jobs.run_next()
  assert store.stats.staged == 1 and store.stats.peak == 1
  assert store.take("a") == ("placed", 1)


def test_the_host_bound_holds_received_batches_and_a_placement_waits_for_a_device_slot():
  store, jobs = StagedBatchStore(1, max_host_batches=1, slot_wait_s=0), Jobs()
  assert store.stage("a", 1, place, defer=jobs).staged
  jobs.run_next()  # a: placed, holds the one device slot
  assert store.stage("b", 2, place, defer=jobs).staged  # b: received, holds the host buffer
  refused = store.stage("c", 3, place, defer=jobs)  # no host buffer left: refused at once
  assert refused.status is StageStatus.REFUSED and "host bound reached: 1 of 1" in refused.reason
  assert "TUNIX_STAGE_MAX_HOST_BATCHES" in refused.reason
  with concurrent.futures.ThreadPoolExecutor(1) as lane:
    store.slot_wait_s = 10
    placing = lane.submit(jobs.run_next)  # b's placement waits for a's device slot
    assert store.take("a") == ("placed", 1)
    placing.result(10)
  assert store.take("b") == ("placed", 2)
  assert store.stats.peak == 1 and store.stats.peak_host == 1


def test_a_failed_placement_hands_the_payload_back_for_an_inline_train():
  store, jobs = StagedBatchStore(1), Jobs()

  def broken(payload):
    raise OSError("DMA error")

  assert store.stage("a", {"x": 1}, broken, defer=jobs).staged
  jobs.run_next()
  with pytest.raises(PlacementFailed, match="prepare failed: OSError: DMA error") as e:
    store.take("a")
  assert e.value.payload == {"x": 1} and e.value.key == "a"
  assert len(store) == 0 and store.stats.unplaced == 1 and store.stats.failed == 1
  assert store.stage("b", 2, place, defer=jobs).staged  # nothing left holding a slot


def test_a_placement_that_never_gets_a_device_slot_becomes_an_inline_train():
  store, jobs = StagedBatchStore(1, slot_wait_s=0), Jobs()
  store.stage("a", 1, place)
  assert store.stage("b", 2, place, defer=jobs).staged
  jobs.run_next()  # a still holds the device slot: b is not placed
  with pytest.raises(PlacementFailed, match="device bound reached") as e:
    store.take("b")
  assert e.value.payload == 2


def test_a_take_of_a_batch_whose_placement_waits_for_a_held_slot_trains_its_payload_at_once():
  """b's placement waits for the device slot a holds; b's train call comes first (another
  client's, or a's queued behind it on the compute lane): waiting would only stall that lane."""
  store, jobs = StagedBatchStore(1, max_host_batches=1, slot_wait_s=60), Jobs()
  assert store.stage("a", 1, place, defer=jobs).staged
  jobs.run_next()  # a: placed, holds the one device slot
  assert store.stage("b", 2, place, defer=jobs).staged
  with concurrent.futures.ThreadPoolExecutor(1) as lane:
    placing = lane.submit(jobs.run_next)  # b's placement: waiting for a's slot
    with pytest.raises(PlacementFailed, match=r"its train call came while it waited for a "
                       r"device slot \(1 of 1 held by other batches") as e:
      store.take("b", timeout=0)  # answered without waiting for the placement
    assert e.value.payload == 2
    placing.result(10)  # the placement saw it and gave up
  assert store.take("a") == ("placed", 1)
  assert len(store) == 0 and store.stats.unplaced == 1 and store.stats.staged == 1


@pytest.mark.parametrize("when", ["received", "placing"])
def test_reset_of_a_split_stage_frees_its_slots(when):
  store, jobs = StagedBatchStore(1, slot_wait_s=0), Jobs()
  entered, release = threading.Event(), threading.Event()

  def slow(payload):
    entered.set()
    assert release.wait(10)
    return payload

  assert store.stage("a", 1, slow, defer=jobs).staged
  with concurrent.futures.ThreadPoolExecutor(1) as lane:
    if when == "placing":
      placing = lane.submit(jobs.run_next)
      assert entered.wait(10)
    assert store.reset(["a"]) == ["a"]
    if when == "received":
      jobs.run_next()  # the queued placement finds it reset and does nothing
      assert not entered.is_set()
    else:
      assert not store.stage("b", 2, place).staged  # a's buffers still exist while placing
      release.set()
      placing.result(10)
  assert len(store) == 0 and store.stage("c", 3, place).staged


def test_a_received_batch_is_placed_before_the_stages_queued_behind_it_on_a_real_lane():
  """Issue 22's repro on a real staging lane: stages b and c arrive while a is being received
  (host bound 1, device bound 1). a's placement runs next on the lane, before b and c: b then
  finds the host buffer free. (Queued behind them, a waited for both to be refused after their
  slot waits, since the unplaced a held the one host buffer.)"""
  store = StagedBatchStore(1, max_host_batches=1, slot_wait_s=5)
  events, receiving, release = [], threading.Event(), threading.Event()

  def check_of(key):
    def check(payload):
      events.append(f"receive {key}")
      if key == "a":
        receiving.set()
        assert release.wait(10)
    return check

  def prepare(payload):
    events.append(f"place {payload}")
    return ("placed", payload)

  def stage(key):
    return store.stage(key, key, prepare, check=check_of(key),
                       defer=executor_lib.defer_on_current_lane())

  with trainer_executor() as ex:
    a = ex.submit("stage_batch", stage, "a")
    assert receiving.wait(10)
    b, c = ex.submit("stage_batch", stage, "b"), ex.submit("stage_batch", stage, "c")
    release.set()
    assert a.result(10).staged
    assert store.take("a") == ("placed", "a")
    assert b.result(10).staged, b.result()
    assert store.take("b") == ("placed", "b")
    assert c.result(10).staged, c.result()
    assert store.take("c") == ("placed", "c")
  assert events == ["receive a", "place a", "receive b", "place b", "receive c", "place c"]
  assert store.stats.refused == 0 and store.stats.unplaced == 0 and len(store) == 0
