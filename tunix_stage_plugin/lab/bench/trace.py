"""Chrome / Perfetto trace of the benchmark: one process per mode run, one thread per track.

Open it at https://ui.perfetto.dev or chrome://tracing. Every run is drawn from its own start
(time 0), so the modes line up for comparison.
"""

from __future__ import annotations

from typing import Sequence

from tunix_stage_plugin.lab.bench import results
from tunix_stage_plugin.core import timeline as timeline_lib


def write_trace(path: str, runs: Sequence[results.ModeRun]) -> None:
  groups = {f"{r.mode} (round {r.round + 1})": timeline_lib.shifted(r.spans, -r.origin)
            for r in runs}
  timeline_lib.write_chrome_trace(path, groups)
