"""Entry point for hosts that load plugins themselves (group `tunix.plugins`, see patches/).

A host that calls its plugin group at start-up needs no .pth bootstrap: it calls `activate`, which
follows the bootstrap's rule: silent when staging is off, installs when it is on, and stops the
process with one line and exit code 2 when a setting is invalid (manager.activate_from_env).
"""

from __future__ import annotations

from tunix_stage_plugin.activation import manager


def activate() -> None:
  manager.activate_from_env("tunix")
