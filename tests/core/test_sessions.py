"""The orchestrator session rule (core/store.py Sessions; the keys' sessions, core/contract.py): a
new orchestrator's first stage drops its predecessors' staged batches on that worker; nothing else is dropped."""

from __future__ import annotations

import logging

from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core.store import Sessions, StagedBatchStore


def test_keys_carry_the_process_session_and_one_prefix_per_loop():
  first, second = contract.next_loop_prefix(), contract.next_loop_prefix()
  assert first != second and first.startswith(f"ts{contract.SESSION}.")
  assert contract.session_of(f"{first}-s0-m3") == contract.SESSION
  assert contract.session_of(f"{second}-s12-m0") == contract.SESSION
  for key in ("t-1", "over-raw", "st0123abcd-s0-m0", f"{first}-s0", f"{first}-s0-m0x", 7):
    assert contract.session_of(key) is None, key


def test_a_new_session_drops_the_older_sessions_batches_once_and_says_so(caplog):
  caplog.set_level(logging.WARNING, logger="tunix_stage_plugin")
  store, rule = StagedBatchStore(4, max_host_batches=4), Sessions()
  dead, new = "tsdeadbeef.0", "ts0badcafe.0"
  for key in (f"{dead}-s3-m1", f"{dead}-s3-m2", "by-hand"):
    assert not rule.admit(store, key)
    assert store.receive(key, key).staged
  # The new orchestrator's first stage: the dead one's batches go, the hand-made key stays.
  assert sorted(rule.admit(store, f"{new}-s0-m0")) == [f"{dead}-s3-m1", f"{dead}-s3-m2"]
  assert store.keys() == ["by-hand"] and rule.dropped == 2
  assert caplog.text.count("older session(s)") == 1
  assert ("orchestrator session ts0badcafe started staging on this trainer: dropped 2 staged "
          "batch(es) of 1 older session(s) (tsdeadbeef)") in caplog.text
  # Its later stages, and its other loops (same process, same session), drop nothing.
  assert store.receive(f"{new}-s0-m0", 1).staged
  assert not rule.admit(store, f"{new}-s0-m1")
  assert not rule.admit(store, "ts0badcafe.1-s0-m0")
  # An older session seen again (a second orchestrator still running) is not new: it drops
  # nothing of the newer one's (one orchestrator per trainer at a time is the assumption).
  assert not rule.admit(store, f"{dead}-s4-m0")
  assert store.keys() == ["by-hand", f"{new}-s0-m0"] and rule.dropped == 2
  assert caplog.text.count("older session(s)") == 1


def test_a_new_session_with_nothing_to_drop_logs_nothing(caplog):
  caplog.set_level(logging.WARNING, logger="tunix_stage_plugin")
  store, rule = StagedBatchStore(1), Sessions()
  assert rule.admit(store, "tsdeadbeef.0-s0-m0") == []
  assert rule.admit(store, "ts0badcafe.0-s0-m0") == []
  assert caplog.text == "" and rule.dropped == 0
