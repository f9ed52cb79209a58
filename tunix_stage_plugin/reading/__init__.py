"""The reading layer: what only a reader of a job's metrics records runs, apart from what a job
loads (no job imports it: tests/test_layout.py). Records read into pandas DataFrames (records.py:
pyarrow's JSON reader under the record's schema; each column's unit and meaning: columns.py),
runs told apart (runs.py), the summary and the advice's window (summary.py), `tunix-stage
report` (report.py), `report A B` (compare.py) and `--png` (picture.py). pandas and pyarrow come
with tunix (its `datasets`); elsewhere the `report` extra installs them. docs/observability.md "The steps as a DataFrame".

    from tunix_stage_plugin import reading
    steps = reading.steps("/tmp/job-metrics")  # a row per process and step
"""

from __future__ import annotations

import warnings

import pandas as pd

from tunix_stage_plugin.reading import records
from tunix_stage_plugin.reading.records import RecordError


class RecordWarning(UserWarning):
  """What `report` prints as a note: a record file's last line cut short, a folder's entry
  skipped."""


def steps(*paths: str) -> pd.DataFrame:
  """The steps the records `paths` hold (the folder TUNIX_STAGE_METRICS named, or record files),
  as one DataFrame: a row per process and step, the trainers' first, each process's in step
  order; its columns `role`, `host`, `hostname`, `pid`, `run` (the run's id), `run_started`,
  `time`, `step`, the settings the step ran with, each figure by its name
  (core/telemetry/figures.py: `step_s`, `input_wait_mid_step_s`, `received_side_bytes`, ...;
  NaN where a step does not know it or its role has no such figure), and `file`, the path of the
  record file the row came from. `reading.columns.columns()` says each column's unit and meaning.
  Each note `report` prints (a last line cut short, an entry skipped) is a RecordWarning. Raises
  RecordError (one line naming the file, the line and the field) for a record that is not
  one."""
  found = records.read(paths)
  for note in found.notes:
    warnings.warn(note, RecordWarning, stacklevel=2)
  frame = pd.concat([t for t in found.steps.values() if len(t)] or [records.empty("trainer")],
                    ignore_index=True)
  # `file` holds each row's index into the files read: their paths instead.
  frame["file"] = pd.Categorical.from_codes(frame["file"].to_numpy(), categories=found.files)
  for name in records.TEXTS:
    frame[name] = frame[name].astype("category")
  return frame


__all__ = ["RecordError", "RecordWarning", "steps"]
