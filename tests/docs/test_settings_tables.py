"""The pages that list the staging variables list all of them, and the hook counts they show agree.

The settings table (`core/config.SETTINGS`) is the one source: configuration.md's table and
launching.md's table of the recipes' variables must each have one row per setting (launching.md
once spoke of "the three staging variables" and listed 4 of 6). The start-up line and doctor's
sample each show how many hooks tunix's adapter installs: the same number on every page (doctor's
sample once said 11 against the start-up line's 13).
"""

from __future__ import annotations

from pathlib import Path
import re

import pytest

from tunix_stage_plugin.core import config as config_lib

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _table_rows(page: Path, heading: str) -> list[str]:
  """The first cell of each row of the first table under `heading`."""
  lines = page.read_text().splitlines()
  start = lines.index(heading)
  rows = []
  for line in lines[start + 1:]:
    if line.startswith("#"):
      break
    if line.startswith("| `"):
      rows.append(line.split("|")[1].strip().strip("`"))
    elif rows and not line.startswith("|"):
      break
  return rows


@pytest.mark.parametrize("page, heading", [("configuration.md", "## The settings"),
                                           ("launching.md", "## Variables")])
def test_a_table_of_the_staging_variables_has_every_setting_once(page, heading):
  assert _table_rows(ROOT / "docs" / page, heading) == [s.env for s in config_lib.SETTINGS]


def test_every_page_shows_one_count_of_tunix_s_hooks():
  counts = {}
  for page in PAGES:
    text = page.read_text()
    for found in re.findall(r"staging on for tunix [^:]*: (\d+) hooks", text) + re.findall(
        r"hooks installed in this process: (\d+)", text):
      counts.setdefault(int(found), []).append(page.name)
  assert len(counts) == 1, counts
