"""The metrics record (TUNIX_STAGE_METRICS) a job writes: one JSON object per line and per step, one
file per process and run, each line flushed as its step ends; a record that cannot be written is
said once and dropped. Schema `SCHEMA`, version `VERSION`: the common fields made here, the
figures as the step aggregators make them (their fields: core/telemetry/figures.py). Reading it
back is the reading layer's (tunix_stage_plugin/reading). docs/observability.md "The record".
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import Any

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core.telemetry import figures as figures_lib

SCHEMA = "tunix-stage-metrics"
VERSION = 2
TRAINER, ORCHESTRATOR = figures_lib.TRAINER, figures_lib.ORCHESTRATOR
ROLES = figures_lib.ROLES

# The staging settings a record carries (those that shape its figures: depths, bounds, codec),
# each in the records of the roles it is for (the settings table's); a reader takes a missing one
# at the table's default. A depth or bound set to auto is carried as the value in force at the
# step (its choice in the role's `sizing`), `auto` where none is in force yet.
CARRIED = tuple(config_lib.SETTINGS_BY_FIELD[field] for field in (
    "max_staged_batches", "max_device_batches", "max_host_batches", "codec"))
# The setting each role sizes at auto: what its records' `sizing` speaks of.
SIZED = {ORCHESTRATOR: "max_staged_batches", TRAINER: "max_host_batches"}
SUFFIX = ".jsonl"


def new_run() -> dict[str, Any]:
  """A run's identity (a process's telemetry makes one, and a new one for each run it starts):
  an id no other run shares, and when it started (Unix seconds)."""
  return {"id": secrets.token_hex(4), "started": time.time()}


def make(role: str, host: str, figures: dict[str, Any], settings: dict[str, Any],
         run: dict[str, Any]) -> dict[str, Any]:
  return {"schema": SCHEMA, "version": VERSION, "role": role, "host": host,
          "process": {"pid": os.getpid(), "hostname": socket.gethostname()}, "run": run,
          "time": time.time(), "settings": settings, **figures}


def file_name(role: str, run: str) -> str:
  return f"{role}-{socket.gethostname()}-{os.getpid()}-{run}{SUFFIX}"


class Writer:
  """Appends one process's records of one run to its file in `directory` (made on the first
  record)."""

  def __init__(self, directory: str, role: str, run: str) -> None:
    self.path = os.path.join(directory, file_name(role, run))
    self._lock = threading.Lock()
    self._file: Any = None
    self._failed = False

  def write(self, record: dict[str, Any]) -> None:
    with self._lock:
      if self._failed:
        return
      try:
        if self._file is None:
          os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
          self._file = open(self.path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()  # the step is on disk (in the OS) before the next begins
      except (OSError, ValueError, TypeError) as e:
        self._failed = True
        print(f"tunix-stage: metrics: cannot write {self.path} ({type(e).__name__}: {e}); the "
              "job goes on without its metrics record", file=sys.stderr, flush=True)

  def close(self) -> None:
    with self._lock:
      if self._file is not None:
        self._file.close()
        self._file = None
