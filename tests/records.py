"""A job's metrics records as a test reads them: each line as JSON (what a user's own tools see),
and the folder read by the reading layer too, which must read every record a job writes."""

from __future__ import annotations

import json
from typing import Any

from tunix_stage_plugin.reading import records as records_lib


def job_records(folder: Any) -> dict[str, list[dict[str, Any]]]:
  """The records in `folder` by role, in each file's order (files by name); raises where the
  reading layer refuses them or finds a line cut short."""
  found = records_lib.read([str(folder)])
  assert found.notes == [], found.notes
  out: dict[str, list[dict[str, Any]]] = {"trainer": [], "orchestrator": []}
  for path in found.files:
    with open(path, encoding="utf-8") as f:
      for line in f:
        rec = json.loads(line)
        out[rec["role"]].append(rec)
  assert {role: len(frame) for role, frame in found.steps.items()} == \
      {role: len(recs) for role, recs in out.items()}
  return out
