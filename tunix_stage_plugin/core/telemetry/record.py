"""The metrics record: one JSON object per line and per step, one file per process.

`TUNIX_STAGE_METRICS=DIR` makes each staging process write `DIR/<role>-<hostname>-<pid>.jsonl`,
each line flushed as its step ends (a killed job keeps every step it finished). A record that
cannot be written is said once and dropped; the job never fails for it. The schema is versioned
(`SCHEMA`, `VERSION`); `read` takes records of this version only, each checked for the fields its
role carries. The fields: docs/observability.md "The record".
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Any, Iterable

SCHEMA = "tunix-stage-metrics"
VERSION = 1
TRAINER, ORCHESTRATOR = "trainer", "orchestrator"
# The fields each role's record carries beside the common ones (one table: the writer's figures
# dicts and `read`'s check).
FIELDS = {
    TRAINER: ("step_s", "compute_s", "input_wait_s", "other_s", "microbatches", "compute",
              "receive", "place", "pool", "staged", "bound_by"),
    ORCHESTRATOR: ("step_s", "microbatches", "depth", "staged", "inline", "prestaged",
                   "peak_staged", "fallbacks", "sent", "stage_calls"),
}
COMMON = ("schema", "version", "role", "host", "process", "time", "step", "settings")
SUFFIX = ".jsonl"


class RecordError(ValueError):
  """A record file that cannot be read as this schema; one line naming the file and line."""


def make(role: str, host: str, figures: dict[str, Any], settings: dict[str, Any]
         ) -> dict[str, Any]:
  return {"schema": SCHEMA, "version": VERSION, "role": role, "host": host,
          "process": {"pid": os.getpid(), "hostname": socket.gethostname()},
          "time": time.time(), "settings": settings, **figures}


def file_name(role: str) -> str:
  return f"{role}-{socket.gethostname()}-{os.getpid()}{SUFFIX}"


class Writer:
  """Appends one process's records to its file in `directory` (made on the first record)."""

  def __init__(self, directory: str, role: str) -> None:
    self.path = os.path.join(directory, file_name(role))
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


def files(paths: Iterable[str]) -> list[str]:
  """The record files `paths` name: a file as given, a directory's *.jsonl files."""
  out = []
  for path in paths:
    if os.path.isdir(path):
      found = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(SUFFIX))
      if not found:
        raise RecordError(f"{path}: a folder with no metrics record in it (*{SUFFIX}); accepted: "
                          "the folder TUNIX_STAGE_METRICS named, or record files")
      out += found
    elif os.path.isfile(path):
      out.append(path)
    else:
      raise RecordError(f"{path}: no such file or folder; accepted: the folder "
                        "TUNIX_STAGE_METRICS named, or record files")
  return out


def read(path: str) -> tuple[list[dict[str, Any]], str | None]:
  """The records of one file, and a note when its last line was cut short (a process killed
  while writing it: the records before it are whole). Raises RecordError for anything else."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as e:
    raise RecordError(f"{path}: cannot be read ({e.strerror or e})") from None
  lines = data.split(b"\n")
  cut = lines.pop() if lines else b""  # what follows the last newline: empty when whole
  records, note = [], None
  for n, raw in enumerate(lines, start=1):
    records.append(_parse(path, n, raw))
  if cut.strip():
    try:
      records.append(_parse(path, len(lines) + 1, cut))
    except RecordError:
      note = (f"{path}: its last line is cut short (the process was killed while writing it); "
              f"read the {len(records)} whole record(s) before it")
  if not records and note is None:
    raise RecordError(f"{path}: holds no record")
  return records, note


def _parse(path: str, n: int, raw: bytes) -> dict[str, Any]:
  where = f"{path}:{n}"
  try:
    record = json.loads(raw)
  except json.JSONDecodeError as e:
    raise RecordError(f"{where}: not a JSON record ({e.msg}); accepted: one {SCHEMA} record "
                      "per line") from None
  except UnicodeDecodeError:
    raise RecordError(f"{where}: not UTF-8 text; accepted: one {SCHEMA} record per line"
                      ) from None
  if not isinstance(record, dict) or record.get("schema") != SCHEMA:
    raise RecordError(f"{where}: not a {SCHEMA} record (its schema field is "
                      f"{record.get('schema') if isinstance(record, dict) else None!r}); "
                      "accepted: the files TUNIX_STAGE_METRICS wrote")
  if record.get("version") != VERSION:
    raise RecordError(f"{where}: schema version {record.get('version')!r} is not one this "
                      f"tunix-stage-plugin reads ({VERSION}); read it with the version that "
                      "wrote it")
  role = record.get("role")
  if role not in FIELDS:
    raise RecordError(f"{where}: role {role!r}; accepted: {' | '.join(FIELDS)}")
  missing = [k for k in (*COMMON, *FIELDS[role]) if k not in record]
  if missing:
    raise RecordError(f"{where}: a {role} record without {missing}")
  return record
