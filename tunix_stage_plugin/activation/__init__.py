"""Activation: install / uninstall the staging hooks into a host (docs/tunix.md "Activation").

Three ways: the env-gated `.pth` bootstrap, `tunix-stage run -- <command>`, and explicit
`install()` / `uninstall()` (drivers with staging flags: `configure(flags.config_from_argparse(
args))`, flags beating the environment). Host adapters are found through the
`tunix_stage_plugin.hosts` entry-point group. The names below are loaded on first use: the
bootstrap imports this package at every interpreter start with staging on, and the manager
(entry points, metadata) is what costs start-up time.
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
