"""observability.md's table of the DataFrame's columns is the one `reading.columns` makes from the
figures' table, and it names every column a real job's DataFrame has, each once."""

from __future__ import annotations

from pathlib import Path

from tunix_stage_plugin import reading
from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.reading import columns as columns_lib

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "observability.md"
JOB = ROOT / "tests" / "data" / "embedded_job"  # a real embedded job's record, both roles


def documented() -> list[str]:
  """The table under "#### The columns", line by line."""
  lines = PAGE.read_text(encoding="utf-8").splitlines()
  start = lines.index("#### The columns")
  first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
  end = next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))
  return lines[first:end]


def test_the_docs_table_is_the_one_the_figures_make():
  assert documented() == columns_lib.markdown()


def test_the_table_names_every_column_of_a_real_job_s_frame_once():
  names = [c.name for c in columns_lib.columns()]
  assert len(names) == len(set(names))
  assert sorted(names) == sorted(reading.steps(str(JOB)).columns)


def test_a_name_both_roles_have_is_one_unit():
  units: dict[str, set[str]] = {}
  for f in figures_lib.FIGURES:
    units.setdefault(f.name, set()).add(f.unit)
  assert {name: u for name, u in units.items() if len(u) > 1} == {}
  shared = {c.name for c in columns_lib.columns() if c.roles == columns_lib.BOTH}
  assert {"staged", "inline"}.isdisjoint(shared)  # placements are the trainer's placed_*
