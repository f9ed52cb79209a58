"""Trainer-side store of staged micro-batches: keyed, bounded in device memory, consumed once.

A stage reserves a slot under the lock, runs the caller's prepare-and-place function outside it
(that is the slow host preparation and host-to-device copy), then publishes the result. Reserved
slots count against the bound, so the number of placed batches never exceeds it; over the bound a
stage is *refused* (never blocks, never evicts: every staged batch is one that will be consumed).

Contract breaks (a malformed, duplicate or unknown key) raise; a stage that fails or is refused
returns a `StageResult` with a reason, because the design says a failed stage degrades to the
inline path.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any, Callable, Iterable

_KEY_RE = re.compile(r"[A-Za-z0-9._:-]+")
MAX_KEY_LEN = 128
KEY_RULE = f"a str of 1-{MAX_KEY_LEN} characters from [A-Za-z0-9._:-]"


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
  peak: int = 0  # most slots (placed or being placed) held at once


class StagedBatchStore:
  """Holds at most `max_device_batches` placed micro-batches, each consumed exactly once."""

  def __init__(self, max_device_batches: int) -> None:
    if not isinstance(max_device_batches, int) or max_device_batches < 1:
      raise ValueError(f"max_device_batches must be an int >= 1; got {max_device_batches!r}")
    self.max_device_batches = max_device_batches
    self._lock = threading.Lock()
    self._entries: dict[str, _Entry] = {}
    # Entries reset while their prepare still runs: their buffers exist until it returns, so
    # they keep holding a slot until then.
    self._draining = 0
    self.stats = StoreStats()

  def __len__(self) -> int:
    with self._lock:
      return len(self._entries)

  def keys(self) -> list[str]:
    with self._lock:
      return list(self._entries)

  def stage(self, key: str, payload: Any, prepare: Callable[[Any], Any]) -> StageResult:
    """Runs `prepare(payload)` into a reserved slot; refuses (does not block) over the bound."""
    check_key(key)
    with self._lock:
      if key in self._entries:
        raise StageKeyError(f"stage key {key!r} is already staged; keys are single-use")
      held = len(self._entries) + self._draining
      if held >= self.max_device_batches:
        self.stats.refused += 1
        return StageResult(
            key, False,
            f"device bound reached: {held} of {self.max_device_batches} staged batches held "
            "(TUNIX_STAGE_MAX_DEVICE_BATCHES)",
        )
      entry = self._entries[key] = _Entry()
      self.stats.peak = max(self.stats.peak, held + 1)
    try:
      value = prepare(payload)
    except Exception as e:  # pylint: disable=broad-except  (any failure degrades to inline)
      with self._lock:
        entry.finished = True
        if entry.dropped:
          self._draining -= 1
        else:
          del self._entries[key]
        self.stats.failed += 1
      entry.error = f"{type(e).__name__}: {e}"
      entry.done.set()
      return StageResult(key, False, f"prepare failed: {entry.error}")
    with self._lock:
      entry.finished = True
      if entry.dropped:  # reset while it was being placed: let the buffers go now
        self._draining -= 1
        entry.error = "reset while staging"
        entry.done.set()
        return StageResult(key, False, "reset while staging")
      entry.value = value
      self.stats.staged += 1
    entry.done.set()
    return StageResult(key, True)

  def take(self, key: str, timeout: float | None = 60.0) -> Any:
    """Removes and returns the staged batch; waits (bounded) if it is still being placed."""
    check_key(key)
    with self._lock:
      entry = self._entries.get(key)
    if entry is None:
      raise StageKeyError(f"stage key {key!r} is not staged (never staged, consumed or reset)")
    if not entry.done.wait(timeout):
      raise TimeoutError(f"stage key {key!r} was still being placed after {timeout} s")
    with self._lock:
      if self._entries.get(key) is not entry or entry.error is not None:
        raise StageKeyError(f"stage key {key!r} is not staged: {entry.error or 'taken or reset'}")
      del self._entries[key]
      self.stats.consumed += 1
    value, entry.value = entry.value, None
    return value

  def reset(self, keys: Iterable[str] | None = None) -> list[str]:
    """Drops the given keys (all when None); returns the keys that were held and are now gone."""
    with self._lock:
      targets = list(self._entries) if keys is None else [check_key(k) for k in keys]
      dropped = []
      for k in targets:
        entry = self._entries.pop(k, None)
        if entry is not None:
          entry.dropped = True
          if not entry.finished:
            self._draining += 1
          entry.value = None
          dropped.append(k)
      self.stats.dropped += len(dropped)
    return dropped
