"""Orchestrator sessions on tunix's host: a restarted orchestrator does not pay for its predecessor.

An orchestrator that dies without its cleanup leaves its staged keys holding the trainer's slots,
and tunix has no call that tells a trainer a new orchestrator started. So each staged loop's keys
carry the orchestrator process's session (`key_prefix()`: `ts<session>.<n>`; core/keys.py builds
and parses it), and a worker that sees a session for the first time drops every staged batch of
the sessions before it (`Sessions.dropped`). Keys without a session are never dropped and never
start one. The rule and its assumption: docs/tunix.md "One orchestrator per trainer".
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading

from tunix_stage_plugin.core import keys as keys_lib
from tunix_stage_plugin.core import store as store_lib

log = logging.getLogger("tunix_stage_plugin")

# This orchestrator process's session, and its loops so far. Per process, not per installation:
# a loop's prefix must never come back while a trainer remembers its keys (an uninstall and
# install in one process keep counting).
SESSION = keys_lib.new_session()
_loops = itertools.count()
REMEMBERED_SESSIONS = 64  # a worker remembers the last these many sessions it saw


def key_prefix() -> str:
  """The key prefix of one staged train loop of this orchestrator process."""
  return keys_lib.session_prefix(SESSION, next(_loops))


class Sessions:
  """One worker's sessions: the first stage of a new one drops the older ones' batches."""

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
    self.dropped = 0  # staged batches dropped because a newer session started

  def admit(self, store: store_lib.StagedBatchStore, key: str) -> list[str]:
    """Called before `key` is staged; returns the keys dropped (a new session's first stage)."""
    session = keys_lib.session_of(key)
    if session is None:
      return []
    with self._lock:
      if session in self._seen:
        return []
      self._seen[session] = None
      while len(self._seen) > REMEMBERED_SESSIONS:
        self._seen.popitem(last=False)
      older = [k for k in store.keys() if keys_lib.session_of(k) not in (None, session)]
      dropped = store.reset(older) if older else []
      self.dropped += len(dropped)
    if dropped:
      sessions = sorted({keys_lib.session_of(k) for k in dropped})
      log.warning("tunix-stage: orchestrator session ts%s started staging on this trainer: "
                  "dropped %d staged batch(es) of %d older session(s) (%s) that no one will "
                  "train (one orchestrator per trainer at a time; docs/tunix.md)", session,
                  len(dropped), len(sessions), ", ".join(f"ts{s}" for s in sessions))
    return dropped
