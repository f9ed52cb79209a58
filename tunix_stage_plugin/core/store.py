"""The trainer's staged micro-batches: keyed, bounded in host and device memory, consumed once.

Two bounded phases, as in grain's `device_put`. `receive` holds a payload in one of
`max_host_batches` host buffers and answers at once, so the next one can cross the wire. The
placer pulls each received batch in order from `placements` once one of `max_device_batches`
device slots is free. `take` hands a placed batch out once; a failed placement hands its payload
back (`PlacementFailed`), trained inline with no second transfer. The store calls nothing of its
host's. A broken key raises; a stage that cannot be held returns a typed `StageOutcome`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
import math
import threading
import time
import weakref
from typing import Any, Iterable, Iterator

from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core.contract import StageKeyError

log = logging.getLogger("tunix_stage_plugin")

# How many keys the store remembers, each kind in its own FIFO: keys reset before their stage
# arrived (that stage is then refused), and keys already used (staging one again is an error).
# Older ones are forgotten; keys carry a per-orchestrator prefix and the step, so none comes back.
REMEMBERED_KEYS = 4096
REMEMBERED_SESSIONS = 64  # a worker remembers the last these many orchestrator sessions it saw


class PlacementFailed(Exception):
  """A received batch was not placed: train it inline from `payload` (no second transfer)."""

  def __init__(self, key: str, payload: Any, reason: str) -> None:
    super().__init__(f"stage key {key!r} could not be placed: {reason}")
    self.key = key
    self.payload = payload
    self.reason = reason


class _State(enum.Enum):
  RECEIVED = "received"  # holds a host buffer, waits for a device slot
  PLACING = "placing"  # holds a device slot while the placer places it
  PLACED = "placed"  # holds a device slot until taken
  UNPLACED = "unplaced"  # its placement failed: take hands the payload back


class _Entry:
  __slots__ = ("key", "state", "done", "payload", "value", "reason", "dropped")

  def __init__(self, key: str, payload: Any) -> None:
    self.key = key
    self.state = _State.RECEIVED
    self.done = threading.Event()  # set once PLACED or UNPLACED (or dropped), for take()
    self.payload = payload  # kept until placed
    self.value: Any = None
    self.reason: str | None = None  # why it is UNPLACED
    self.dropped = False  # reset: gone from the store; a running placement still holds buffers


@dataclasses.dataclass
class StoreStats:
  staged: int = 0  # placed
  consumed: int = 0  # taken after placement
  refused: int = 0
  failed: int = 0  # placements that raised
  unplaced: int = 0  # taken after a failed placement (trained inline from the held payload)
  dropped: int = 0
  slot_waits: int = 0  # receives (or placements) that had to wait for a buffer (or a slot)
  peak: int = 0  # most device slots (placed or being placed) held at once
  peak_host: int = 0  # most received-but-unplaced host buffers held at once


def _check_bound(name: str, value: Any) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name} must be an int >= 1; got {value!r}")


class Placing:
  """One placement the placer runs: `with job: job.done(place(job.payload))`. Leaving the block
  on an exception marks the batch failed (its payload trains inline); an interrupt propagates."""

  def __init__(self, store: "StagedBatchStore", entry: _Entry) -> None:
    self._store = store
    self._entry = entry
    self.key = entry.key
    self.payload = entry.payload

  def done(self, value: Any) -> None:
    self._store._placed(self._entry, value)  # pylint: disable=protected-access

  def __enter__(self) -> "Placing":
    return self

  def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
    del tb
    self.payload = None
    if error is not None:
      self._store._failed(self._entry, f"prepare failed: {kind.__name__}: {error}")  # pylint: disable=protected-access
      return isinstance(error, Exception)  # the placer goes on; an interrupt propagates
    if self._entry.state is _State.PLACING and not self._entry.dropped:
      self._store._failed(self._entry, "the placer returned no placed batch")  # pylint: disable=protected-access
    return False


class StagedBatchStore:
  """At most `max_device_batches` placed (or placing) micro-batches and `max_host_batches`
  received ones waiting for a slot, each consumed exactly once."""

  def __init__(self, max_device_batches: int, *, max_host_batches: int = 1,
               slot_wait_s: float = 30.0) -> None:
    _check_bound("max_device_batches", max_device_batches)
    _check_bound("max_host_batches", max_host_batches)
    if (not isinstance(slot_wait_s, (int, float)) or isinstance(slot_wait_s, bool)
        or not math.isfinite(slot_wait_s) or slot_wait_s < 0):
      raise ValueError(f"slot_wait_s must be a finite number of seconds >= 0; got {slot_wait_s!r}")
    self.max_device_batches = max_device_batches
    self.max_host_batches = max_host_batches
    self.slot_wait_s = slot_wait_s
    self._cond = threading.Condition()
    self._entries: dict[str, _Entry] = {}
    self._queue: collections.deque[_Entry] = collections.deque()  # received, in arrival order
    self._pending: set[str] = set()  # receives waiting for a host buffer
    self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
    self._used: collections.OrderedDict[str, None] = collections.OrderedDict()
    # Entries reset while being placed: their buffers exist until the placement returns, so they
    # keep holding a device slot until then.
    self._draining = 0
    self._closed = False
    self.stats = StoreStats()
    self._window_peaks = (0, 0)  # (device, host) since take_peaks last ran

  def __len__(self) -> int:
    with self._cond:
      return len(self._entries)

  def set_bounds(self, max_device_batches: int, max_host_batches: int) -> None:
    """New bounds for stages to come (a reconfiguration); what is held stays held."""
    _check_bound("max_device_batches", max_device_batches)
    _check_bound("max_host_batches", max_host_batches)
    with self._cond:
      self.max_device_batches, self.max_host_batches = max_device_batches, max_host_batches
      self._cond.notify_all()

  def take_peaks(self) -> tuple[int, int]:
    """The most device slots and host buffers held at once since the last call (or the start);
    the peaks then start again from what is held now (a step's peaks, for its telemetry)."""
    with self._cond:
      peaks = self._window_peaks
      self._window_peaks = (self._held(), self._held_host())
      return peaks

  def keys(self) -> list[str]:
    with self._cond:
      return list(self._entries)

  def _held(self) -> int:
    return self._draining + sum(e.state in (_State.PLACING, _State.PLACED)
                                for e in self._entries.values())

  def _held_host(self) -> int:
    return sum(e.state in (_State.RECEIVED, _State.UNPLACED) for e in self._entries.values())

  def _note_peaks(self) -> None:
    held, held_host = self._held(), self._held_host()
    self.stats.peak = max(self.stats.peak, held)
    self.stats.peak_host = max(self.stats.peak_host, held_host)
    self._window_peaks = (max(self._window_peaks[0], held), max(self._window_peaks[1], held_host))

  def _refuse(self, key: str, reason: str) -> contract.StageOutcome:
    self.stats.refused += 1
    return contract.refused(key, reason)

  @staticmethod
  def _remember(fifo: collections.OrderedDict[str, None], key: str) -> None:
    fifo[key] = None
    while len(fifo) > REMEMBERED_KEYS:
      fifo.popitem(last=False)

  def _wait_for(self, room: Any, cancelled: Any) -> bool:
    """Under the lock: waits at most slot_wait_s for `room()`; False on timeout or cancel."""
    if room():
      return not cancelled()
    self.stats.slot_waits += 1
    deadline = time.monotonic() + self.slot_wait_s
    while not room() and not cancelled():
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        return False
      self._cond.wait(remaining)
    return not cancelled()

  def _device_bound(self) -> str:
    return (f"device bound reached: {self._held()} of {self.max_device_batches} staged batches "
            f"held for {self.slot_wait_s} s (TUNIX_STAGE_MAX_DEVICE_BATCHES)")

  def receive(self, key: str, payload: Any, *, refuse: str | None = None
              ) -> contract.StageOutcome:
    """Holds `payload` under `key` in a host buffer for the placer; STAGED at once.

    `refuse`: why this payload can never be staged (the host's check of it, done first): refused
    now, before any wait. Refused too after `slot_wait_s` without a host buffer, or when its key
    was reset first."""
    contract.check_key(key)
    with self._cond:
      if key in self._entries or key in self._pending or key in self._used:
        raise StageKeyError(f"stage key {key!r} was already used; keys are single-use")
      self._remember(self._used, key)
      if self._cancelled.pop(key, 0) is None:
        return self._refuse(key, "reset before it was staged")
      if refuse is not None:
        return self._refuse(key, f"not stageable: {refuse}")
      self._pending.add(key)  # until it holds a buffer or is refused; a reset now tombstones it
      try:
        if not self._wait_for(lambda: self._held_host() < self.max_host_batches,
                              lambda: key in self._cancelled or self._closed):
          if self._cancelled.pop(key, 0) is None or self._closed:
            return self._refuse(key, "reset while waiting for a host buffer")
          return self._refuse(
              key, f"host bound reached: {self._held_host()} of {self.max_host_batches} received "
              f"batches held for {self.slot_wait_s} s (TUNIX_STAGE_MAX_HOST_BATCHES)")
        entry = self._entries[key] = _Entry(key, payload)
        self._queue.append(entry)
        self._note_peaks()
        self._cond.notify_all()  # the placer may be waiting for it
      finally:
        self._pending.discard(key)
    return contract.staged(key)

  def placements(self) -> Iterator[Placing]:
    """The placer's loop: each received batch, in arrival order, once a device slot is free for
    it (a batch that waits `slot_wait_s` for one becomes an inline train instead). Blocks while
    nothing is received; ends once the store is closed."""
    while True:
      with self._cond:
        entry = self._next_received()
        if entry is None:
          return
        if not self._wait_for(lambda: self._held() < self.max_device_batches,
                              lambda: (entry.dropped or entry.state is not _State.RECEIVED
                                       or self._closed)):
          if entry.state is _State.RECEIVED and not entry.dropped and not self._closed:
            self._unplaced(entry, self._device_bound())
          continue
        entry.state = _State.PLACING
        self._note_peaks()
        self._cond.notify_all()  # its host buffer is free for the next receive
      yield Placing(self, entry)

  def _next_received(self) -> _Entry | None:
    """Under the lock: the oldest batch still waiting to be placed; None once closed."""
    while not self._closed:
      while self._queue:
        entry = self._queue.popleft()
        if entry.state is _State.RECEIVED and not entry.dropped:
          return entry
      self._cond.wait()
    return None

  def _unplaced(self, entry: _Entry, reason: str) -> None:
    """Under the lock: the entry keeps its payload for an inline train."""
    entry.state, entry.reason = _State.UNPLACED, reason
    entry.done.set()
    self._cond.notify_all()

  def _placed(self, entry: _Entry, value: Any) -> None:
    with self._cond:
      if entry.dropped:  # reset while it was being placed: let the buffers go now
        self._draining -= 1
        entry.value = None
      else:
        entry.state, entry.value, entry.payload = _State.PLACED, value, None
        self.stats.staged += 1
      entry.done.set()
      self._cond.notify_all()

  def _failed(self, entry: _Entry, reason: str) -> None:
    with self._cond:
      self.stats.failed += 1
      entry.reason = reason
      if entry.dropped:
        self._draining -= 1
        entry.done.set()
        self._cond.notify_all()
      else:  # its stage was answered STAGED: the payload trains inline instead
        self._unplaced(entry, reason)

  def take(self, key: str, timeout: float | None = 60.0) -> Any:
    """Removes and returns the placed batch; waits (bounded) while it is received or placing.

    Raises PlacementFailed (carrying the payload) when its placement failed or cannot happen.
    """
    contract.check_key(key)
    with self._cond:
      entry = self._entries.get(key)
      if (entry is not None and entry.state is _State.RECEIVED
          and self._held() - self._draining >= self.max_device_batches):
        # Its placement waits for a device slot that only a take or a reset frees, and takes
        # queue on the caller's lane behind this one: train it from its payload now.
        self._unplaced(entry, f"its train call came while it waited for a device slot "
                       f"({self._held()} of {self.max_device_batches} held by other batches, "
                       f"TUNIX_STAGE_MAX_DEVICE_BATCHES)")
    if entry is None:
      raise StageKeyError(f"stage key {key!r} is not staged (never staged, consumed or reset)")
    if not entry.done.wait(timeout):
      raise TimeoutError(f"stage key {key!r} was still being placed after {timeout} s")
    with self._cond:
      if self._entries.get(key) is not entry:
        raise StageKeyError(f"stage key {key!r} is not staged: {entry.reason or 'taken or reset'}")
      del self._entries[key]
      self._cond.notify_all()
      if entry.state is _State.UNPLACED:
        self.stats.unplaced += 1
        payload, entry.payload = entry.payload, None
        raise PlacementFailed(key, payload, entry.reason)
      self.stats.consumed += 1
    value, entry.value = entry.value, None
    return value

  def reset(self, keys: Iterable[str] | None = None) -> list[str]:
    """Drops the given keys (all when None); returns the keys that were held and are now gone.

    A named key that is not held yet is remembered, so a stage for it arriving later (its
    request overtaken by this reset) is refused instead of holding a slot nobody will free.
    """
    if isinstance(keys, (str, bytes)):
      raise TypeError(f"reset takes a list of stage keys or None; got {type(keys).__name__} "
                      f"{keys!r} (for one key, pass [{keys!r}])")
    with self._cond:
      if keys is None:
        targets = list(self._entries)
        for k in self._pending:
          self._remember(self._cancelled, k)
      else:
        targets = [contract.check_key(k) for k in keys]
      dropped = []
      for k in targets:
        entry = self._entries.pop(k, None)
        if entry is None:
          if k not in self._used or k in self._pending:
            self._remember(self._cancelled, k)
          continue
        entry.dropped = True
        if entry.state is _State.PLACING:
          self._draining += 1
        entry.value = entry.payload = None
        entry.done.set()
        dropped.append(k)
      self.stats.dropped += len(dropped)
      self._cond.notify_all()
    return dropped

  def close(self) -> list[str]:
    """Drops every batch and ends `placements` (the placer's loop); returns the dropped keys."""
    dropped = self.reset()
    with self._cond:
      self._closed = True
      self._cond.notify_all()
    return dropped


class Sessions:
  """One worker's orchestrator sessions: the first stage of a new one drops the older ones'
  batches. An orchestrator that dies without its cleanup leaves its staged keys holding the
  trainer's slots, and tunix has no call that tells a trainer a new orchestrator started; each
  staged loop's keys carry its process's session (core/contract.py), so a new session shows it. Keys
  without a session never drop anything. docs/tunix.md "One orchestrator per trainer"."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
    self.dropped = 0  # staged batches dropped because a newer session started

  def admit(self, store: StagedBatchStore, key: str) -> list[str]:
    """Called before `key` is staged; returns the keys dropped (a new session's first stage)."""
    session = contract.session_of(key)
    if session is None:
      return []
    with self._lock:
      if session in self._seen:
        return []
      self._seen[session] = None
      while len(self._seen) > REMEMBERED_SESSIONS:
        self._seen.popitem(last=False)
      older = [k for k in store.keys() if contract.session_of(k) not in (None, session)]
      dropped = store.reset(older) if older else []
      self.dropped += len(dropped)
    if dropped:
      sessions = sorted({contract.session_of(k) for k in dropped})
      log.warning("tunix-stage: orchestrator session ts%s started staging on this trainer: "
                  "dropped %d staged batch(es) of %d older session(s) (%s) that no one will "
                  "train (one orchestrator per trainer at a time; docs/tunix.md)", session,
                  len(dropped), len(sessions), ", ".join(f"ts{s}" for s in sessions))
    return dropped


# Which stores hold batches placed through which target (the trainer object whose preparation
# placed them), so a host event that makes them wrong (MaxText's restore_checkpoint or close) can
# drop them. The process's, as the hosts' placements registry is.
_holders_lock = threading.Lock()
_holders: "weakref.WeakKeyDictionary[Any, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def track(target: Any, store: StagedBatchStore) -> None:
  """`store` holds batches placed through `target`."""
  with _holders_lock:
    _holders.setdefault(target, weakref.WeakSet()).add(store)


def discard(target: Any) -> list[str]:
  """Drops every batch placed through `target` (their device buffers go); returns their keys."""
  with _holders_lock:
    stores = list(_holders.get(target, ()))
  return [key for store in stores for key in store.reset()]
