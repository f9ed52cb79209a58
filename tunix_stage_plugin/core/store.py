"""Trainer-side store of staged micro-batches: keyed, bounded in device memory, consumed once.

Why a slot wait and tombstones, and what each outcome means: README, "Core semantics".
Contract breaks (a malformed, reused or unknown key) raise; a stage that fails or is refused
returns a typed `StageOutcome`, because a failed stage degrades to the inline path.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import threading
import time
from typing import Any, Callable, Iterable

from tunix_stage_plugin.core import outcome as outcome_lib

_KEY_RE = re.compile(r"[A-Za-z0-9._:-]+")
MAX_KEY_LEN = 128
KEY_RULE = f"a str of 1-{MAX_KEY_LEN} characters from [A-Za-z0-9._:-]"
# How many keys the store remembers, each kind in its own FIFO: keys reset before their stage
# arrived (that stage is then refused), and keys already used (staging one again is an error).
# Beyond these many, the oldest are forgotten; keys carry a per-orchestrator prefix and the step.
REMEMBERED_KEYS = 4096


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
    if (not isinstance(max_device_batches, int) or isinstance(max_device_batches, bool)
        or max_device_batches < 1):
      raise ValueError(f"max_device_batches must be an int >= 1; got {max_device_batches!r}")
    if (not isinstance(slot_wait_s, (int, float)) or isinstance(slot_wait_s, bool)
        or not math.isfinite(slot_wait_s) or slot_wait_s < 0):
      raise ValueError(f"slot_wait_s must be a finite number of seconds >= 0; got {slot_wait_s!r}")
    self.max_device_batches = max_device_batches
    self.slot_wait_s = slot_wait_s
    self._cond = threading.Condition()
    self._entries: dict[str, _Entry] = {}
    self._pending: set[str] = set()  # stages checking their payload or waiting for a slot
    self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
    self._used: collections.OrderedDict[str, None] = collections.OrderedDict()
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

  def _refuse(self, key: str, reason: str) -> outcome_lib.StageOutcome:
    self.stats.refused += 1
    return outcome_lib.refused(key, reason)

  @staticmethod
  def _remember(fifo: collections.OrderedDict[str, None], key: str) -> None:
    fifo[key] = None
    while len(fifo) > REMEMBERED_KEYS:
      fifo.popitem(last=False)

  def stage(self, key: str, payload: Any, prepare: Callable[[Any], Any], *,
            check: Callable[[Any], None] | None = None) -> outcome_lib.StageOutcome:
    """Runs `prepare(payload)` into a reserved slot; refuses after `slot_wait_s` without one.

    `check(payload)`, when given, runs first and raises for a payload that can never be staged:
    it is refused at once, before waiting for a slot.
    """
    check_key(key)
    with self._cond:
      if key in self._entries or key in self._pending or key in self._used:
        raise StageKeyError(f"stage key {key!r} was already used; keys are single-use")
      self._remember(self._used, key)
      if self._cancelled.pop(key, 0) is None:
        return self._refuse(key, "reset before it was staged")
      self._pending.add(key)  # until it holds a slot or is refused; a reset now tombstones it
    try:
      if check is not None:
        try:
          check(payload)
        except Exception as e:  # pylint: disable=broad-except  (the reason travels back)
          with self._cond:
            return self._refuse(key, f"not stageable: {type(e).__name__}: {e}")
      with self._cond:
        waited = self._held() >= self.max_device_batches and key not in self._cancelled
        if waited:
          self.stats.slot_waits += 1
          deadline = time.monotonic() + self.slot_wait_s
          while self._held() >= self.max_device_batches and key not in self._cancelled:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
              return self._refuse(
                  key, f"device bound reached: {self._held()} of {self.max_device_batches} "
                  f"staged batches held for {self.slot_wait_s} s (TUNIX_STAGE_MAX_DEVICE_BATCHES)")
            self._cond.wait(remaining)
        if self._cancelled.pop(key, 0) is None:
          return self._refuse(key, "reset while waiting for a device slot" if waited
                              else "reset before it was placed")
        entry = self._entries[key] = _Entry()
        self.stats.peak = max(self.stats.peak, self._held())
    finally:
      with self._cond:
        self._pending.discard(key)
    try:
      value = prepare(payload)
    except BaseException as e:  # pylint: disable=broad-except  (any failure degrades to inline)
      entry.error = f"{type(e).__name__}: {e}"
      with self._cond:
        self._finish(key, entry)
        self.stats.failed += 1
      if not isinstance(e, Exception):
        raise  # KeyboardInterrupt, SystemExit: the slot is free, the interrupt goes on
      return outcome_lib.failed(key, f"prepare failed: {entry.error}")
    with self._cond:
      dropped = entry.dropped
      if dropped:  # reset while it was being placed: let the buffers go now
        entry.error = "reset while staging"
      else:
        entry.value = value
        self.stats.staged += 1
      self._finish(key, entry, keep=not dropped)
    if dropped:
      return outcome_lib.refused(key, "reset while staging")
    return outcome_lib.staged(key)

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
    if isinstance(keys, (str, bytes)):
      raise TypeError(f"reset takes a list of stage keys or None; got {type(keys).__name__} "
                      f"{keys!r} (for one key, pass [{keys!r}])")
    with self._cond:
      if keys is None:
        targets = list(self._entries)
        for k in self._pending:
          self._remember(self._cancelled, k)
      else:
        targets = [check_key(k) for k in keys]
      dropped = []
      for k in targets:
        entry = self._entries.pop(k, None)
        if entry is None:
          if k not in self._used or k in self._pending:
            self._remember(self._cancelled, k)
          continue
        entry.dropped = True
        if not entry.finished:
          self._draining += 1
        entry.value = None
        dropped.append(k)
      self.stats.dropped += len(dropped)
      self._cond.notify_all()
    return dropped
