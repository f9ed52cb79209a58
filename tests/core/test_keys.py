"""Stage keys (core/contract.py): one format, built, checked and parsed in one place."""

from __future__ import annotations

import pytest

from tunix_stage_plugin.core import contract


def test_a_pipeline_key_is_built_and_parsed_back():
  key = contract.build_key("ts0badcafe.3", 12, 0)
  assert key == "ts0badcafe.3-s12-m0" and contract.check_key(key) == key
  assert contract.parse_key(key) == contract.PipelineKey("ts0badcafe.3", 12, 0)
  for other in ("by-hand", "x-s1", "x-s1-m2y", "-s1-m2", 7):
    assert contract.parse_key(other) is None, other


def test_a_prefix_leaves_room_for_the_step_and_index_within_the_key_rule():
  prefix = "p" * contract.MAX_PREFIX_LEN
  assert contract.check_prefix(prefix) == prefix
  assert contract.check_key(contract.build_key(prefix, 10 ** 12, 10 ** 12))
  with pytest.raises(ValueError, match=r"at most 96 characters from \[A-Za-z0-9._:-\]"):
    contract.check_prefix(prefix + "p")
  with pytest.raises(contract.StageKeyError, match=r"\[A-Za-z0-9._:-\]"):
    contract.check_prefix("a b")
  with pytest.raises(contract.StageKeyError, match="of length 0"):
    contract.check_key("")


def test_a_prefix_carries_a_session_or_a_runs_own_mark():
  session = contract.new_session()
  prefix = contract.session_prefix(session, 3)
  assert prefix == f"ts{session}.3" and contract.check_prefix(prefix) == prefix
  assert contract.session_of(contract.build_key(prefix, 1, 2)) == session
  run = contract.run_prefix()
  assert run != contract.run_prefix() and contract.check_prefix(run) == run
  assert contract.session_of(contract.build_key(run, 0, 0)) is None
