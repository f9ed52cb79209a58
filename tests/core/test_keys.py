"""Stage keys (core/keys.py): one format, built, checked and parsed in one place."""

from __future__ import annotations

import pytest

from tunix_stage_plugin.core import keys


def test_a_pipeline_key_is_built_and_parsed_back():
  key = keys.build("ts0badcafe.3", 12, 0)
  assert key == "ts0badcafe.3-s12-m0" and keys.check(key) == key
  assert keys.parse(key) == keys.PipelineKey("ts0badcafe.3", 12, 0)
  for other in ("by-hand", "x-s1", "x-s1-m2y", "-s1-m2", 7):
    assert keys.parse(other) is None, other


def test_a_prefix_leaves_room_for_the_step_and_index_within_the_key_rule():
  prefix = "p" * keys.MAX_PREFIX_LEN
  assert keys.check_prefix(prefix) == prefix
  assert keys.check(keys.build(prefix, 10 ** 12, 10 ** 12))
  with pytest.raises(ValueError, match=r"at most 96 characters from \[A-Za-z0-9._:-\]"):
    keys.check_prefix(prefix + "p")
  with pytest.raises(keys.StageKeyError, match=r"\[A-Za-z0-9._:-\]"):
    keys.check_prefix("a b")
  with pytest.raises(keys.StageKeyError, match="of length 0"):
    keys.check("")


def test_a_prefix_carries_a_session_or_a_runs_own_mark():
  session = keys.new_session()
  prefix = keys.session_prefix(session, 3)
  assert prefix == f"ts{session}.3" and keys.check_prefix(prefix) == prefix
  assert keys.session_of(keys.build(prefix, 1, 2)) == session
  run = keys.run_prefix()
  assert run != keys.run_prefix() and keys.check_prefix(run) == run
  assert keys.session_of(keys.build(run, 0, 0)) is None
