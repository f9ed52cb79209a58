"""StagedBatchStore: keyed, bounded, consumed once, clear errors, safe under concurrency.

A stage is received (`receive`, answered at once) and placed by whoever pulls `placements`: a
test pulls one job at a time (`place_next`) where it needs the order by hand, or runs a placer
thread as the hosts do (`Placer`)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from tunix_stage_plugin.core.contract import StageStatus
from tests.core.engines import trainer_executor
from tunix_stage_plugin.core.store import PlacementFailed, StagedBatchStore, StageKeyError


def place(payload):
  return ("placed", payload)


def place_next(jobs, fn=place):
  """Places the next received batch here, as a placer thread would (`jobs`: store.placements())."""
  job = next(jobs)
  with job:
    job.done(fn(job.payload))


class Placer:
  """A placer thread, as a host's: each received batch placed with `fn` (per payload: `fns`)."""

  def __init__(self, store, fn=place, fns=None):
    self.store, self.fn, self.fns = store, fn, fns or {}
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()

  def _run(self):
    for job in self.store.placements():
      with job:
        job.done(self.fns.get(job.payload, self.fn)(job.payload))

  def close(self):
    self.store.close()
    self.thread.join(10)
    assert not self.thread.is_alive()


@pytest.fixture
def placed():
  """A store with a placer thread: `placed(store, ...)` starts it; closed after the test."""
  placers = []

  def start(store, fn=place, fns=None):
    placers.append(Placer(store, fn, fns))
    return store

  yield start
  for p in placers:
    p.close()


def test_stage_then_take_once(placed):
  store = placed(StagedBatchStore(1))
  result = store.receive("k1", 7)
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
  for call in (lambda: store.receive(key, 1), lambda: store.take(key),
               lambda: store.reset([key])):
    with pytest.raises(StageKeyError) as e:
      call()
    assert fragment in str(e.value) and "[A-Za-z0-9._:-]" in str(e.value)


def test_longest_allowed_key_is_accepted():
  assert StagedBatchStore(1).receive("k" * 128, 1).staged


def test_duplicate_key_is_an_error_and_keeps_the_first(placed):
  store = placed(StagedBatchStore(2))
  store.receive("k", 1)
  with pytest.raises(StageKeyError, match="already used; keys are single-use"):
    store.receive("k", 2)
  assert store.take("k") == ("placed", 1)


def test_over_the_bound_refuses_with_reason_and_never_evicts():
  store = StagedBatchStore(1, max_host_batches=2, slot_wait_s=0)
  assert store.receive("a", 1).staged and store.receive("b", 2).staged
  refused = store.receive("c", 3)
  assert not refused.staged and "host bound reached: 2 of 2 received batches held for 0" in \
      refused.reason
  assert "TUNIX_STAGE_MAX_HOST_BATCHES" in refused.reason
  assert store.keys() == ["a", "b"] and store.stats.refused == 1
  jobs = store.placements()
  place_next(jobs)  # a leaves its host buffer for the device slot
  assert store.receive("c2", 3).staged  # room again once one is placed


def test_prepare_failure_is_reported_and_frees_the_slot():
  store = StagedBatchStore(1)
  jobs = store.placements()

  def broken(payload):
    raise ValueError("bad shape")

  assert store.receive("a", 1).staged
  place_next(jobs, broken)
  with pytest.raises(PlacementFailed, match="prepare failed: ValueError: bad shape"):
    store.take("a")
  assert store.receive("b", 2).staged
  place_next(jobs)
  assert store.take("b") == ("placed", 2) and store.stats.failed == 1


def test_reset_some_or_all():
  store = StagedBatchStore(3, max_host_batches=3)
  for k in "abc":
    store.receive(k, k)
  assert store.reset(["b", "zz"]) == ["b"]  # unknown keys are simply not there to drop
  assert store.keys() == ["a", "c"]
  assert sorted(store.reset()) == ["a", "c"] and len(store) == 0


def test_reset_while_placing_keeps_the_slot_until_placement_ends():
  store = StagedBatchStore(1, slot_wait_s=30)
  jobs = store.placements()
  entered, release = threading.Event(), threading.Event()

  def slow(payload):
    entered.set()
    assert release.wait(10)
    return payload

  store.receive("a", 1)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    placing = pool.submit(place_next, jobs, slow)
    assert entered.wait(10)
    assert store.reset() == ["a"]
    assert store.receive("b", 2).staged  # a's host buffer is free: it is being placed
    release.set()
    placing.result(10)
  # The buffers being placed still existed: b got the device slot only once a's placement ended.
  place_next(jobs)
  assert store.take("b") == ("placed", 2)
  assert store.stats.peak == 1 and len(store) == 0


def test_take_waits_for_a_batch_still_being_placed():
  store = StagedBatchStore(1)
  jobs = store.placements()
  entered, release = threading.Event(), threading.Event()

  def slow(payload):
    entered.set()
    assert release.wait(10)
    return ("placed", payload)

  assert store.receive("a", 1).staged
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    placing = pool.submit(place_next, jobs, slow)
    assert entered.wait(10)
    taken = pool.submit(store.take, "a")
    assert not taken.done()
    release.set()
    assert taken.result(10) == ("placed", 1)
    placing.result(10)


def test_take_of_a_failed_placement_names_the_failure():
  store = StagedBatchStore(1)
  jobs = store.placements()
  entered, release = threading.Event(), threading.Event()

  def failing(payload):
    entered.set()
    assert release.wait(10)
    raise OSError("transfer aborted")

  store.receive("a", 1)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    pool.submit(place_next, jobs, failing)
    assert entered.wait(10)
    taken = pool.submit(store.take, "a")
    release.set()
    with pytest.raises(PlacementFailed, match="OSError: transfer aborted"):
      taken.result(10)


def test_take_times_out_instead_of_blocking_forever():
  store = StagedBatchStore(1)
  jobs = store.placements()
  entered, release = threading.Event(), threading.Event()

  def stuck(payload):
    entered.set()
    release.wait(10)
    return payload

  store.receive("a", 1)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pool.submit(place_next, jobs, stuck)
    assert entered.wait(10)
    with pytest.raises(TimeoutError, match="still being placed"):
      store.take("a", timeout=0.01)
    release.set()


@pytest.mark.parametrize("slot_wait_s", [0, 10])
def test_concurrent_stagers_never_exceed_the_bound(placed, slot_wait_s):
  """Six stagers against one placer: the store's own count of the slots held, taken under its
  lock at every change, never passes the bounds (an outside count would race the placer, which
  places the next batch the moment a take frees a slot)."""
  bound = 3
  store = placed(StagedBatchStore(bound, max_host_batches=2, slot_wait_s=slot_wait_s))

  def worker(i):
    outcomes = []
    for j in range(200):
      key = f"w{i}-{j}"
      if store.receive(key, key).staged:
        try:
          outcomes.append(store.take(key) == ("placed", key))
        except PlacementFailed:  # no device slot within the wait: its payload trains inline
          outcomes.append(True)
    return outcomes

  with concurrent.futures.ThreadPoolExecutor(6) as pool:
    results = [r for f in [pool.submit(worker, i) for i in range(6)] for r in f.result(60)]
  assert all(results) and len(results) == store.stats.consumed + store.stats.unplaced
  assert store.stats.peak <= bound and store.stats.peak_host <= 2 and len(store) == 0
  assert len(results) + store.stats.refused == 6 * 200
  if slot_wait_s:  # every holder releases its buffer promptly: waiting stages always get one
    # (a take that finds its batch waiting for a slot the other stagers' batches hold trains
    # its payload at once, as many clients on one trainer may)
    assert store.stats.refused == 0 and store.stats.staged + store.stats.unplaced == 6 * 200


def test_a_full_store_waits_for_the_buffer_a_placement_frees():
  store = StagedBatchStore(1, slot_wait_s=30)
  jobs = store.placements()
  store.receive("a", 1)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    waiting = pool.submit(store.receive, "b", 2)
    # The stage of b arrived before a's placement took it out of its host buffer.
    place_next(jobs)
    assert waiting.result(10).staged
  assert store.keys() == ["a", "b"] and store.stats.slot_waits == 1


def test_a_full_store_refuses_after_its_slot_wait():
  store = StagedBatchStore(1, slot_wait_s=0.05)
  store.receive("a", 1)
  refused = store.receive("b", 2)  # nobody places a: bounded wait, then a reason
  assert not refused.staged and "held for 0.05 s" in refused.reason and store.keys() == ["a"]


def test_reset_refuses_a_stage_waiting_for_a_buffer():
  store = StagedBatchStore(1, slot_wait_s=30)
  store.receive("a", 1)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    waiting = pool.submit(store.receive, "b", 2)
    while not store.stats.slot_waits:  # b is registered as waiting under the lock
      threading.Event().wait(0.001)
    assert store.reset(["b"]) == []
    result = waiting.result(10)
  assert not result.staged and result.reason == "reset while waiting for a host buffer"
  assert store.keys() == ["a"]


def test_a_stage_overtaken_by_its_reset_is_refused():
  """A reset that reaches the trainer before its stage (or while the host checks the payload,
  which it does before receiving it) is remembered: the stage is refused, holds nothing."""
  store = StagedBatchStore(1)
  assert store.reset(["late"]) == []
  result = store.receive("late", 1)
  assert result.status is StageStatus.REFUSED
  assert result.reason == "reset before it was staged" and len(store) == 0
  assert store.receive("other", 2).staged


def test_bound_must_be_a_positive_int():
  for bad in (0, -1, 1.5, "2"):
    with pytest.raises(ValueError, match="max_device_batches must be an int >= 1"):
      StagedBatchStore(bad)


def test_reset_of_a_single_str_is_refused_not_iterated():
  store = StagedBatchStore(2, max_host_batches=2)
  store.receive("ab", 1)
  with pytest.raises(TypeError, match=r"got str 'ab' \(for one key, pass \['ab'\]\)"):
    store.reset("ab")
  assert store.keys() == ["ab"]
  assert store.receive("a", 2).staged  # no tombstone was left for 'a' or 'b'


@pytest.mark.parametrize("finish", ["take", "reset", "refused", "failed"])
def test_a_used_key_cannot_be_staged_again(finish):
  store = StagedBatchStore(1, slot_wait_s=0)
  jobs = store.placements()
  if finish == "refused":
    store.receive("other", 0)
    assert not store.receive("k", 1).staged
  elif finish == "failed":
    assert store.receive("k", 1).staged
    place_next(jobs, lambda p: 1 / 0)
    with pytest.raises(PlacementFailed):
      store.take("k")
  else:
    store.receive("k", 1)
    place_next(jobs)
    getattr(store, finish)(*(["k"] if finish == "take" else [["k"]]))
  with pytest.raises(StageKeyError, match="'k' was already used; keys are single-use"):
    store.receive("k", 2)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_inside_prepare_frees_the_slot_and_propagates(interrupt):
  store = StagedBatchStore(1, slot_wait_s=0)
  jobs = store.placements()

  def interrupted(payload):
    raise interrupt()

  store.receive("a", 1)
  with pytest.raises(interrupt):
    place_next(jobs, interrupted)
  with pytest.raises(PlacementFailed):
    store.take("a")  # its payload trains inline
  assert len(store) == 0 and store.receive("b", 2).staged
  place_next(store.placements())
  assert store.take("b") == ("placed", 2)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, "5", True])
def test_slot_wait_must_be_a_finite_number(value):
  with pytest.raises(ValueError, match="slot_wait_s must be a finite number of seconds >= 0"):
    StagedBatchStore(1, slot_wait_s=value)


def test_an_unstageable_payload_is_refused_before_waiting_for_a_slot():
  store = StagedBatchStore(1, slot_wait_s=3600)  # a wait would hang this test
  store.receive("a", 1)
  result = store.receive("b", "not an array",
                         refuse="TypeError: a TrainerPayload is not a JAX pytree")
  assert result.status is StageStatus.REFUSED
  assert result.reason == "not stageable: TypeError: a TrainerPayload is not a JAX pytree"
  assert store.keys() == ["a"] and store.stats.slot_waits == 0


# --- the two phases: received now, placed next -------------------------------------------------


def test_a_stage_answers_once_received_and_places_later():
  store = StagedBatchStore(1, max_host_batches=1)
  jobs = store.placements()
  assert store.receive("a", 1).staged
  assert store.stats.staged == 0 and store.stats.peak_host == 1  # received, not yet placed
  place_next(jobs)
  assert store.stats.staged == 1 and store.stats.peak == 1
  assert store.take("a") == ("placed", 1)


def test_the_host_bound_holds_received_batches_and_a_placement_waits_for_a_device_slot():
  store = StagedBatchStore(1, max_host_batches=1, slot_wait_s=0)
  jobs = store.placements()
  assert store.receive("a", 1).staged
  place_next(jobs)  # a: placed, holds the one device slot
  assert store.receive("b", 2).staged  # b: received, holds the host buffer
  refused = store.receive("c", 3)  # no host buffer left: refused at once
  assert refused.status is StageStatus.REFUSED and "host bound reached: 1 of 1" in refused.reason
  assert "TUNIX_STAGE_MAX_HOST_BATCHES" in refused.reason
  with concurrent.futures.ThreadPoolExecutor(1) as lane:
    store.slot_wait_s = 10
    placing = lane.submit(place_next, jobs)  # b's placement waits for a's device slot
    assert store.take("a") == ("placed", 1)
    placing.result(10)
  assert store.take("b") == ("placed", 2)
  assert store.stats.peak == 1 and store.stats.peak_host == 1


def test_a_failed_placement_hands_the_payload_back_for_an_inline_train():
  store = StagedBatchStore(1)
  jobs = store.placements()

  def broken(payload):
    raise OSError("DMA error")

  assert store.receive("a", {"x": 1}).staged
  place_next(jobs, broken)
  with pytest.raises(PlacementFailed, match="prepare failed: OSError: DMA error") as e:
    store.take("a")
  assert e.value.payload == {"x": 1} and e.value.key == "a"
  assert len(store) == 0 and store.stats.unplaced == 1 and store.stats.failed == 1
  assert store.receive("b", 2).staged  # nothing left holding a slot


def test_a_placement_that_never_gets_a_device_slot_becomes_an_inline_train():
  store = StagedBatchStore(1, max_host_batches=2, slot_wait_s=0)
  jobs = store.placements()
  store.receive("a", 1)
  assert store.receive("b", 2).staged
  place_next(jobs)  # a: placed, holds the device slot
  with concurrent.futures.ThreadPoolExecutor(1) as lane:
    placing = lane.submit(lambda: next(jobs, None))  # b's placement: no slot within its wait
    with pytest.raises(PlacementFailed, match="device bound reached") as e:
      store.take("b")
    store.close()  # the placer waits for the next batch: end it
    assert placing.result(10) is None
  assert e.value.payload == 2


def test_a_take_of_a_batch_whose_placement_waits_for_a_held_slot_trains_its_payload_at_once():
  """b's placement waits for the device slot a holds; b's train call comes first (another
  client's, or a's queued behind it on the compute lane): waiting would only stall that lane."""
  store = StagedBatchStore(1, max_host_batches=1, slot_wait_s=60)
  jobs = store.placements()
  assert store.receive("a", 1).staged
  place_next(jobs)  # a: placed, holds the one device slot
  assert store.receive("b", 2).staged
  with concurrent.futures.ThreadPoolExecutor(1) as lane:
    placing = lane.submit(lambda: next(jobs, None))  # b's placement: waiting for a's slot
    while not store.stats.slot_waits:
      threading.Event().wait(0.001)
    with pytest.raises(PlacementFailed, match=r"its train call came while it waited for a "
                       r"device slot \(1 of 1 held by other batches") as e:
      store.take("b", timeout=0)  # answered without waiting for the placement
    assert e.value.payload == 2
    assert store.take("a") == ("placed", 1)
    store.close()  # the placer saw b go and waits for the next batch: end it
    assert placing.result(10) is None
  assert len(store) == 0 and store.stats.unplaced == 1 and store.stats.staged == 1


@pytest.mark.parametrize("when", ["received", "placing"])
def test_reset_of_a_staged_batch_frees_its_slots(when):
  store = StagedBatchStore(1, slot_wait_s=0)
  jobs = store.placements()
  entered, release = threading.Event(), threading.Event()

  def slow(payload):
    entered.set()
    assert release.wait(10)
    return payload

  assert store.receive("a", 1).staged
  with concurrent.futures.ThreadPoolExecutor(1) as lane:
    if when == "placing":
      placing = lane.submit(place_next, jobs, slow)
      assert entered.wait(10)
    assert store.reset(["a"]) == ["a"]
    if when == "received":
      assert store.receive("b", 2).staged  # a's host buffer is free
      place_next(jobs)  # the placer skips the reset a and places b
      assert not entered.is_set() and store.take("b") == ("placed", 2)
    else:
      assert store.receive("b", 2).staged
      release.set()
      placing.result(10)
      place_next(jobs)  # b gets the slot once a's placement ended
      assert store.take("b") == ("placed", 2) and store.stats.peak == 1
  assert len(store) == 0 and store.receive("c", 3).staged


def test_a_received_batch_is_placed_while_the_next_stages_queue_on_a_real_lane(placed):
  """Issue 22's repro on a real staging lane: stages b and c arrive while a is being received
  (host bound 1, device bound 1). a's placement runs on the placer thread at once, so b then
  finds the host buffer free, and c after b is placed. (Queued behind them, a waited for both
  to be refused after their slot waits, since the unplaced a held the one host buffer.)"""
  store = StagedBatchStore(1, max_host_batches=1, slot_wait_s=5)
  events, receiving, release = [], threading.Event(), threading.Event()

  def prepare(payload):
    events.append(f"place {payload}")
    return ("placed", payload)

  placed(store, prepare)

  def stage(key):
    events.append(f"receive {key}")
    if key == "a":
      receiving.set()
      assert release.wait(10)
    return store.receive(key, key)

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
  assert events[0] == "receive a"
  assert events.index("place a") < events.index("place b") < events.index("place c")
  assert store.stats.refused == 0 and store.stats.unplaced == 0 and len(store) == 0


def test_close_ends_the_placer_and_drops_what_is_held():
  store = StagedBatchStore(1, max_host_batches=2)
  placer = Placer(store)
  store.receive("a", 1)
  assert store.take("a") == ("placed", 1)
  store.receive("b", 2)
  placer.close()  # ends placements(): the placer thread returns
  assert len(store) == 0
