"""Entry point for hosts that load plugins themselves (group `tunix.plugins`, see patches/).

A host that calls its plugin group at start-up needs no .pth bootstrap: it calls `activate`, which
installs the hooks when TUNIX_STAGE_BATCH=stage (or its flag) says so and is silent otherwise.
"""

from __future__ import annotations

from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core import config as config_lib


def activate() -> None:
  try:
    config = config_lib.resolve()
  except config_lib.ConfigError:
    manager.install()  # reports the invalid value in its one line
    return
  if config.enabled:
    manager.install(config, host="tunix")
