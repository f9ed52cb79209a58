"""Trainer-side store of staged micro-batches: keyed, bounded in device memory, consumed once.

A stage reserves a device slot under the lock, runs the caller's prepare-and-place function
outside it (the slow host preparation and host-to-device copy), then publishes the result.
Reserved slots count against the bound, so placed batches never exceed it.

When every slot is held, a stage waits at most `slot_wait_s` for one to free, then is *refused*
with a reason; it never blocks forever and never evicts (every staged batch will be consumed).
The short wait is what makes a bound of 1 usable: the orchestrator sends fwd_bwd(k) and then
stage(k+1), but the two run on different threads, so stage(k+1) can arrive a moment before
fwd_bwd(k) has taken k out of its slot.

Contract breaks (a malformed, duplicate or unknown key) raise; a stage that fails or is refused
returns a `StageResult` with a reason, because a failed stage degrades to the inline path.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
import time
from typing import Any, Callable, Iterable

_KEY_RE = re.compile(r"[A-Za-z0-9._:-]+")
MAX_KEY_LEN = 128
KEY_RULE = f"a str of 1-{MAX_KEY_LEN} characters from [A-Za-z0-9._:-]"
_TOMBSTONES = 4096  # keys reset before their stage arrived, remembered so it is refused


class StageKeyError(KeyError):
  """A staging key is malformed, already in use, or not staged."""

  def __str__(self) -> str:  # KeyError repr()s its argument; we want the sentence.
    return str(self.args[0])


def check_key(key: Any) -> str:
  if not isinstance(key, str):
    raise StageKeyError(f"stage key must be {KEY_RULE}; got {type(key).__name__} {key!r}")
  if not 1 <= len(key) <= MAX_KEY_LEN:
    raise StageKeyError(f"stage key must be {KEY_RULE}; got one of length {len(key)}")
  if not _KEY_RE.fullmatch(key):
    raise StageKeyError(f"stage key must be {KEY_RULE}; got {key!r}")
  return key


@dataclasses.dataclass(frozen=True)
class StageResult:
  key: str
  staged: bool
  reason: str | None = None  # why not staged


class _Entry:
  __slots__ = ("done", "finished", "value", "error", "dropped")

  def __init__(self) -> None:
    self.done = threading.Event()  # set after `finished`, for waiters outside the lock
    self.finished = False  # prepare returned or raised; written under the store lock
    self.value: Any = None
    self.error: str | None = None
    self.dropped = False


@dataclasses.dataclass
class StoreStats:
  staged: int = 0
  consumed: int = 0
  refused: int = 0
  failed: int = 0
  dropped: int = 0
  slot_waits: int = 0  # stages that had to wait for a slot
  peak: int = 0  # most slots (placed or being placed) held at once


class StagedBatchStore:
  """Holds at most `max_device_batches` placed micro-batches, each consumed exactly once."""

  def __init__(self, max_device_batches: int, *, slot_wait_s: float = 30.0) -> None:
    if not isinstance(max_device_batches, int) or max_device_batches < 1:
      raise ValueError(f"max_device_batches must be an int >= 1; got {max_device_batches!r}")
    if slot_wait_s < 0:
      raise ValueError(f"slot_wait_s must be >= 0; got {slot_wait_s!r}")
    self.max_device_batches = max_device_batches
    self.slot_wait_s = slot_wait_s
    self._cond = threading.Condition()
    self._entries: dict[str, _Entry] = {}
    self._waiting: set[str] = set()  # stages waiting for a slot
    self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
    # Entries reset while their prepare still runs: their buffers exist until it returns, so
    # they keep holding a slot until then.
    self._draining = 0
    self.stats = StoreStats()

  def __len__(self) -> int:
    with self._cond:
      return len(self._entries)

  def keys(self) -> list[str]:
    with self._cond:
      return list(self._entries)

  def _held(self) -> int:
    return len(self._entries) + self._draining

  def _refuse(self, key: str, reason: str) -> StageResult:
    self.stats.refused += 1
    return StageResult(key, False, reason)

  def stage(self, key: str, payload: Any, prepare: Callable[[Any], Any]) -> StageResult:
    """Runs `prepare(payload)` into a reserved slot; refuses after `slot_wait_s` without one."""
    check_key(key)
    with self._cond:
      if key in self._entries or key in self._waiting:
        raise StageKeyError(f"stage key {key!r} is already staged; keys are single-use")
      if self._cancelled.pop(key, 0) is None:
        return self._refuse(key, "reset before it was staged")
      if self._held() >= self.max_device_batches:
        self.stats.slot_waits += 1
        self._waiting.add(key)
        deadline = time.monotonic() + self.slot_wait_s
        try:
          while self._held() >= self.max_device_batches and key not in self._cancelled:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
              return self._refuse(
                  key, f"device bound reached: {self._held()} of {self.max_device_batches} "
                  f"staged batches held for {self.slot_wait_s} s (TUNIX_STAGE_MAX_DEVICE_BATCHES)")
            self._cond.wait(remaining)
        finally:
          self._waiting.discard(key)
        if self._cancelled.pop(key, 0) is None:
          return self._refuse(key, "reset while waiting for a device slot")
      entry = self._entries[key] = _Entry()
      self.stats.peak = max(self.stats.peak, self._held())
    try:
      value = prepare(payload)
    except Exception as e:  # pylint: disable=broad-except  (any failure degrades to inline)
      entry.error = f"{type(e).__name__}: {e}"
      with self._cond:
        self._finish(key, entry)
        self.stats.failed += 1
      return StageResult(key, False, f"prepare failed: {entry.error}")
    with self._cond:
      dropped = entry.dropped
      if dropped:  # reset while it was being placed: let the buffers go now
        entry.error = "reset while staging"
      else:
        entry.value = value
        self.stats.staged += 1
      self._finish(key, entry, keep=not dropped)
    return StageResult(key, False, "reset while staging") if dropped else StageResult(key, True)

  def _finish(self, key: str, entry: _Entry, keep: bool = False) -> None:
    """Under the lock: marks `entry` placed (keep) or gone, and frees its slot if it is gone."""
    entry.finished = True
    if entry.dropped:
      self._draining -= 1
    elif not keep:
      del self._entries[key]
    entry.done.set()
    self._cond.notify_all()

  def take(self, key: str, timeout: float | None = 60.0) -> Any:
    """Removes and returns the staged batch; waits (bounded) if it is still being placed."""
    check_key(key)
    with self._cond:
      entry = self._entries.get(key)
    if entry is None:
      raise StageKeyError(f"stage key {key!r} is not staged (never staged, consumed or reset)")
    if not entry.done.wait(timeout):
      raise TimeoutError(f"stage key {key!r} was still being placed after {timeout} s")
    with self._cond:
      if self._entries.get(key) is not entry or entry.error is not None:
        raise StageKeyError(f"stage key {key!r} is not staged: {entry.error or 'taken or reset'}")
      del self._entries[key]
      self.stats.consumed += 1
      self._cond.notify_all()
    value, entry.value = entry.value, None
    return value

  def reset(self, keys: Iterable[str] | None = None) -> list[str]:
    """Drops the given keys (all when None); returns the keys that were held and are now gone.

    A named key that is not held yet is remembered, so a stage for it arriving later (its
    request overtaken by this reset) is refused instead of holding a slot nobody will free.
    """
    with self._cond:
      if keys is None:
        targets = list(self._entries)
        self._cancelled.update(dict.fromkeys(self._waiting))
      else:
        targets = [check_key(k) for k in keys]
      dropped = []
      for k in targets:
        entry = self._entries.pop(k, None)
        if entry is None:
          self._cancelled[k] = None
          continue
        entry.dropped = True
        if not entry.finished:
          self._draining += 1
        entry.value = None
        dropped.append(k)
      while len(self._cancelled) > _TOMBSTONES:
        self._cancelled.popitem(last=False)
      self.stats.dropped += len(dropped)
      self._cond.notify_all()
    return dropped
