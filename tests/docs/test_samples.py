"""The per-step lines README.md and docs/*.md show are what the plugin prints: each sample line is
the line core/telemetry/lines.py makes of the figures below (one trainer step, one orchestrator
step of a 16 MiB job at the default settings, each ending with its step's choice), character for
character. A change to the line changes the pages with it.

The other samples (the commands' output in console blocks) are run for real:
test_documented_commands.py.
"""

from __future__ import annotations

from pathlib import Path
import re

import pytest

from tunix_stage_plugin.core.telemetry import lines

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MIB = 1 << 20

TRAINER = {
    "step": 3, "step_s": 2.45, "compute_s": 2.40,
    "input_wait_s": {"mid_step": 0.0, "boundary": 0.01}, "other_s": 0.04,
    "compute": {"slowdown_s": 0.03, "beside_transfer": 3},
    "receive": {"calls": 4, "bytes": 64 * MIB, "seconds": 64 * MIB / (2.10 * (1 << 30)),
                "by_transport": {"side": {"calls": 4, "bytes": 64 * MIB,
                                          "seconds": 64 * MIB / (2.10 * (1 << 30))}}},
    # All 4 placed staged: the line says what staging saved (4 receives and placements).
    "place": {"count": 4, "seconds": 0.02, "staged": 4}, "pool": {"waits": 0, "wait_s": 0.0},
    "bound_by": "compute",
    # At the default (auto) the line ends with the step's choice and why.
    "sizing": "host bound 1: no transfer waited for a buffer in 3 step(s); budget 6.00 GiB, 32.0 MiB used",
}
ORCHESTRATOR = {
    "step": 3, "microbatches": 4, "staged": 3, "prestaged": 1, "inline": 1,
    "fallbacks": {"count": 0, "by_kind": {}},
    "sent": {"side": {"calls": 4, "bytes": 64 * MIB, "seconds": 4 * 0.012}},
    "stage_calls": {"count": 3, "median_s": 0.01},
    "sizing": ("depth 1: a micro-batch's stage 0.02 s against 0.60 s of compute, 2x spikes "
               "included, over the last 3 step(s); budget 6.00 GiB, 16.0 MiB used"),
}
PRINTED = {"tunix-stage: trainer step ": lines.trainer_line(TRAINER),
           "tunix-stage: step ": lines.orchestrator_line(ORCHESTRATOR)}


def _samples() -> list[tuple[str, str]]:
  """(page:line, the line) for each per-step line a page shows."""
  found = []
  for page in PAGES:
    for n, line in enumerate(page.read_text().splitlines(), 1):
      if re.match(r"tunix-stage: (trainer )?step \d+: ", line):
        found.append((f"{page.relative_to(ROOT)}:{n}", line))
  return found


SAMPLES = _samples()


def test_the_pages_show_both_lines():
  shown = {line.split(":", 2)[1].strip().split()[0] for _, line in SAMPLES}
  assert shown == {"trainer", "step"}, SAMPLES


@pytest.mark.parametrize("where,line", SAMPLES, ids=[w for w, _ in SAMPLES])
def test_a_sample_per_step_line_is_the_line_the_plugin_prints(where, line):
  (printed,) = [p for start, p in PRINTED.items() if line.startswith(start)]
  assert line == printed, f"{where} shows a line the plugin does not print; it prints:\n{printed}"
