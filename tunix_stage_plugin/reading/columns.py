"""The columns of `reading.steps`' DataFrame: each one's roles, unit and meaning. The figures' come
from their one table (core/telemetry/figures.py); the record's own fields from OWN below.
docs/observability.md "The steps as a DataFrame" holds `markdown()` as its table (a test keeps
them equal). `python -m tunix_stage_plugin.reading.columns` prints it.
"""

from __future__ import annotations

import dataclasses

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.core.telemetry import record as record_lib

BOTH = "both"
UNIX_S = "Unix s"
# The record's own fields, as columns: (unit, meaning). `file` is the reader's.
OWN = {
    "role": (figures_lib.TEXT, "trainer or orchestrator"),
    "host": (figures_lib.TEXT, "the host that wrote the record: tunix, maxtext or embedded"),
    "hostname": (figures_lib.TEXT, "the process's machine"),
    "pid": (figures_lib.COUNT, "the process's id"),
    "run": (figures_lib.TEXT, "the run's id (NaN in a version-1 record, which has none)"),
    "run_started": (UNIX_S, "when the run started"),
    "time": (UNIX_S, "when the record was made, as the step ended"),
    "step": (figures_lib.COUNT, "the step: the trainer counts its updates, the orchestrator its "
             "train loop's steps"),
}


@dataclasses.dataclass(frozen=True)
class Column:
  name: str
  roles: str  # trainer, orchestrator or BOTH
  unit: str
  what: str


def _setting(setting: config_lib.Setting) -> Column:
  counted = config_lib.COUNT_ACCEPTED in setting.accepted
  what = f"{setting.env} in force at the step"
  if config_lib.AUTO in setting.accepted:
    what += " (at auto, the value it chose)"
  return Column(setting.field, setting.roles[0] if len(setting.roles) == 1 else BOTH,
                figures_lib.COUNT if counted else figures_lib.TEXT,
                what + "; NaN in the other role's rows")


def columns() -> list[Column]:
  """Every column of the DataFrame: the record's own fields, the settings a record carries, each
  figure (a name both roles have once, its unit theirs), then `file`."""
  out = [Column(name, BOTH, unit, what) for name, (unit, what) in OWN.items()]
  out += [_setting(s) for s in record_lib.CARRIED]
  seen: dict[str, list[figures_lib.Figure]] = {}
  for f in figures_lib.FIGURES:
    seen.setdefault(f.name, []).append(f)
  for name, figures in seen.items():
    if len(figures) == 1:
      out.append(Column(name, figures[0].role, figures[0].unit, figures[0].what))
    else:
      out.append(Column(name, BOTH, figures[0].unit,
                        "; ".join(f"{f.role}: {f.what}" for f in figures)))
  out.append(Column("file", BOTH, figures_lib.TEXT, "the record file the row was read from (a "
                    "path given, or one found in a folder given)"))
  return out


def markdown() -> list[str]:
  """The columns as the docs' table: a line per row."""
  rows = ["| column | rows | unit | what |", "|---|---|---|---|"]
  rows += [f"| `{c.name}` | {c.roles} | {c.unit} | {c.what} |" for c in columns()]
  return rows


if __name__ == "__main__":
  print("\n".join(markdown()))
