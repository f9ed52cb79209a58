"""Activation: install / uninstall the staging hooks into a host, three ways.

1. The env-gated bootstrap (`tunix_stage_plugin.pth`, shipped with the package): nothing happens
   unless TUNIX_STAGE_BATCH is set (and not "off"); then the configuration is resolved, and the
   hooks installed, when the host is first imported. An invalid setting stops that process there
   with exit code 2 and one line naming the variable.
2. The wrapper `tunix-stage run -- <command>`: sets the environment for the bootstrap, then execs.
3. Explicit `tunix_stage_plugin.install()` / `uninstall()`; drivers with staging flags call
   `configure(flags.config_from_argparse(args))`, so flags beat the environment.

Host adapters are found through the `tunix_stage_plugin.hosts` entry-point group. The names below
are loaded on first use: the bootstrap imports this package at every interpreter start with
staging on, and the manager (entry points, metadata) is what costs start-up time.
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
