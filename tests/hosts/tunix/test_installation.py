"""tunix host's installation state (hosts/tunix/installation.py and the trainer's side it makes):
the trainer's receive pool is bounded by what its workers may hold staged, and follows a
reconfiguration; one metrics logger per process is told each trainer step."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

# pylint: disable=wrong-import-position
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.hosts.tunix import adapter
from tunix_stage_plugin.hosts.tunix import installation as installation_lib

pytestmark = pytest.mark.tunix


class _Worker:
  """Stands for a TrainerWorker: the trainer's side keys its staging by the object only."""


def _installation(live: config_lib.LiveConfig) -> installation_lib.Installation:
  tunix = adapter.TunixAdapter()
  tunix.load()
  return installation_lib.Installation(live, tunix.modules, patching.PatchRegistry())


def test_the_receive_pool_is_bounded_by_the_workers_staging_bounds():
  live = config_lib.LiveConfig(config_lib.resolve(
      {"mode": "stage", "max_device_batches": 2, "max_host_batches": 1}, env={}))
  inst = _installation(live)
  try:
    assert inst.trainer_side().pool.bound == 3  # before any worker stages: one worker's room
    first, second = _Worker(), _Worker()
    inst.trainer_side().staging_of(first)
    assert inst.trainer_side().pool.bound == 3
    inst.trainer_side().staging_of(second)
    inst.trainer_side().staging_of(first)
    assert inst.trainer_side().pool.bound == 6  # two workers on one node: room for both
    live.update(config_lib.resolve(
        {"mode": "stage", "max_device_batches": 4, "max_host_batches": 2}, env={}))
    assert inst.trainer_side().pool.bound == 12
    assert inst.trainer_side().staging_of(second).store.max_device_batches == 4
  finally:
    inst.close()


def test_one_metrics_logger_per_process_is_told_each_trainer_step():
  """The figures are the process's and a logger's backends listen process-wide: the first
  logger met gets a step sink, once; another trainer's logger gets none (no double logging)."""
  inst = _installation(config_lib.LiveConfig(config_lib.resolve({"mode": "stage"}, env={})))
  made = []

  class Sink:
    def __init__(self, logger):
      made.append(logger)

    def step(self, figures):
      del figures

  placement = types.SimpleNamespace(step_sink=lambda target, logger: Sink(logger))
  try:
    first, second = object(), object()
    for logger in (first, first, second):
      inst.trainer_side()._log_into(placement, object(), logger)  # pylint: disable=protected-access
    assert made == [first]
  finally:
    inst.close()
