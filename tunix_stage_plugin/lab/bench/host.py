"""What the bench's runner needs of a host, so one runner, report, checks and trace serve every
host (docs/bench.md "Hosts").

A host owns its processes and how a mode runs on them; the runner owns the rounds, the
calibration's re-tries, the re-runs of noisy mode runs and the progress lines. Each host fills in
results.Calibration and results.ModeRun the same way (one clock: the orchestrator's; step
timings from the trainer's device compute spans, metrics.py).
"""

from __future__ import annotations

import importlib
from typing import Callable, Protocol

from tunix_stage_plugin.lab.bench import modes as modes_lib
from tunix_stage_plugin.lab.bench import results
from tunix_stage_plugin.lab.embedded import data as data_lib

Say = Callable[[str], None]


class HostError(RuntimeError):
  """A host's trainer side failed (did not start, died, or answered wrongly); str() is one line
  saying what and where. The bench command prints it and exits 1."""


class BenchHost(Protocol):
  """One host's trainer side and orchestrator, for one bench run's options."""

  # The host's own processes (the runner counts other processes' cores while it measures).
  pids: tuple[int, ...]

  def start(self, say: Say) -> None:
    """Starts the trainer process(es) and returns once they serve."""

  def stop(self) -> int | None:
    """Stops them (idempotent; a signal may cut the first call short): the first non-zero exit
    code among them, else 0 (None when nothing was started)."""

  async def open(self) -> None:
    """Connects, in the event loop the runs use."""

  async def close(self) -> None:
    """Disconnects (idempotent)."""

  async def calibrate(self, sizes: data_lib.Sizes) -> results.Calibration:
    """One calibration: compile, then the resident compute per micro-batch and the update, the
    other processes' cores meanwhile (`foreign_cores`), and the links the host's modes use."""

  async def run_mode(self, calibration: results.Calibration, mode: str, round_: int,
                     make: data_lib.BatchMaker) -> results.ModeRun:
    """One mode run: WARMUP_STEPS + options.steps steps of `make`'s micro-batches, from the same
    initial parameters as every other run."""


def load(options: results.BenchOptions) -> BenchHost:
  """The host `options.host` names (modes.HOSTS), made for `options`. Its module is imported
  here, so a host's own libraries load only when it runs."""
  module = importlib.import_module(modes_lib.HOST_BY_NAME[options.host].module)
  return module.BenchHost(options)
