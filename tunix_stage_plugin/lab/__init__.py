"""The lab: what only `tunix-stage bench` and `tunix-stage simulate` load, never a tunix job.

- embedded: the plugin's own host (a JAX trainer process served over gRPC on 127.0.0.1, a bulk
  channel for array bytes, emulated links, and its orchestrator), the bench's subject.
- bench: the staging A/B over the embedded host (runner, metrics, report, plot, trace).
- sim: the real core pipeline in virtual time, fed by recorded times.
- inputs, rss: the lab commands' input checks and the processes' memory figures.

The production path (activation, core, hosts, cli) imports nothing from here (a test blocks this
package and imports it); the lab's third-party libraries come with the `bench` extra
(docs/design.md "Layout").
"""

from __future__ import annotations

import importlib.util

EXTRA = "bench"
# What the lab imports beyond the plugin's runtime dependencies.
LIBRARIES = ("optax", "looptime")


def missing_line(command: str) -> str | None:
  """One line naming the lab libraries `command` cannot run without, or None when all are here."""
  missing = [name for name in LIBRARIES if importlib.util.find_spec(name) is None]
  if not missing:
    return None
  from tunix_stage_plugin.core import install_hint  # pylint: disable=import-outside-toplevel
  return (f"tunix-stage {command}: error: needs {', '.join(missing)} (the '{EXTRA}' extra): "
          f"{install_hint.install_command(EXTRA)}")
