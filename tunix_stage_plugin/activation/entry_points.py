"""Finds host adapters through the `tunix_stage_plugin.hosts` entry-point group."""

from __future__ import annotations

import importlib.metadata
from typing import Any

ENTRY_POINT_GROUP = "tunix_stage_plugin.hosts"


def host_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
  return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def load_adapter(name: str) -> Any:
  """Loads the adapter registered under `name`; raises LookupError naming what is registered."""
  eps = host_entry_points()
  if name not in eps:
    from tunix_stage_plugin.core import install_hint  # pylint: disable=import-outside-toplevel
    raise LookupError(
        f"no host adapter {name!r} in entry-point group {ENTRY_POINT_GROUP!r} (registered: "
        f"{sorted(eps) or 'none'}); is tunix-stage-plugin installed "
        f"({install_hint.install_command()})?")
  return eps[name].load()

