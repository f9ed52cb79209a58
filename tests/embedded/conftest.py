"""The embedded tests' shared trainer: one real trainer process per test module."""

from __future__ import annotations

import pytest

from tunix_stage_plugin.lab.embedded import process as process_lib


@pytest.fixture(scope="module")
def trainer():
  """A trainer process (device bound 2) for the module's tests; it must exit cleanly."""
  with process_lib.TrainerProcess(max_device_batches=2) as proc:
    yield proc
  assert proc.proc.returncode == 0
