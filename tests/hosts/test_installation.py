"""tunix host's installation state (hosts/tunix/installation.py, no tunix needed): the trainer's
receive pool is bounded by what its workers may hold staged, and follows a reconfiguration."""

from __future__ import annotations

import functools

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.hosts.tunix import installation as installation_lib


class _Worker:
  """Stands for a TrainerWorker: the installation keys its state by the object only."""


def test_the_receive_pool_is_bounded_by_the_workers_staging_bounds():
  live = config_lib.LiveConfig(config_lib.resolve(
      {"mode": "stage", "max_device_batches": 2, "max_host_batches": 1}, env={}))
  inst = installation_lib.Installation(live)
  try:
    assert inst.pool.bound == 3  # before any worker stages: one worker's room
    first, second = _Worker(), _Worker()
    inst.staging_of(first)
    assert inst.pool.bound == 3
    inst.staging_of(second)
    inst.staging_of(first)
    assert inst.pool.bound == 6  # two workers on one node: room for both
    live.update(config_lib.resolve(
        {"mode": "stage", "max_device_batches": 4, "max_host_batches": 2}, env={}))
    assert inst.pool.bound == 12
    assert inst.staging_of(second).store.max_device_batches == 4
  finally:
    inst.close()


def test_one_metrics_logger_per_process_is_told_each_trainer_step():
  """The figures are the process's and a logger's backends listen process-wide: the first
  logger met gets a step sink, once; another trainer's logger gets none (no double logging)."""
  inst = installation_lib.Installation(config_lib.LiveConfig(config_lib.resolve(
      {"mode": "stage"}, env={})))
  made = []

  class Sink:
    def __init__(self, logger):
      made.append(logger)

    def step(self, figures):
      del figures

  try:
    first, second = object(), object()
    for logger in (first, first, second):
      inst.log_into(logger, functools.partial(Sink, logger))
    assert made == [first]
  finally:
    inst.close()
