"""Activation: install / uninstall the staging hooks into a host (docs/tunix.md "Activation, three
ways": the `.pth` bootstrap, `tunix-stage run`, explicit `install()` / `configure()`).

The names below are loaded on first use: the bootstrap imports this package at every interpreter
start with staging on, and the manager (entry points, metadata) is what costs start-up time.
"""

from __future__ import annotations

_MANAGER_NAMES = frozenset({"Activation", "configure", "current_config", "install",
                            "installed_hooks", "is_installed", "uninstall"})


def __getattr__(name: str):
  if name in _MANAGER_NAMES:
    from tunix_stage_plugin.activation import manager  # pylint: disable=import-outside-toplevel

    return getattr(manager, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | _MANAGER_NAMES)
