"""Fixtures several test folders share."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.fixture(name="tiny_run", scope="session")
def fixture_tiny_run(tmp_path_factory):
  """One real tiny quick bench run for the session (tests/bench reads its report, files and
  progress lines; tests/sim checks and replays it): (the finished process, its output folder).
  Its files are read, never written."""
  out = tmp_path_factory.mktemp("tiny") / "out"
  cmd = [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--tiny", "--quick",
         "--steps", "1", "--microbatches", "3", "--payload_mib", "0.05", "--out", str(out)]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=240), out
