"""Activation: install / uninstall the staging hooks into a host, three ways.

1. The env-gated bootstrap (`tunix_stage_plugin.pth`, shipped with the package): nothing happens
   unless TUNIX_STAGE_BATCH=stage; then the hooks install when the host is first imported.
2. The wrapper `tunix-stage run -- <command>`: sets the environment for the bootstrap, then execs.
3. Explicit `tunix_stage_plugin.install()` / `uninstall()`; drivers with staging flags call
   `configure(flags.config_from_argparse(args))`, so flags beat the environment.

Host adapters are found through the `tunix_stage_plugin.hosts` entry-point group.
"""

from tunix_stage_plugin.activation.manager import Activation
from tunix_stage_plugin.activation.manager import configure
from tunix_stage_plugin.activation.manager import current_config
from tunix_stage_plugin.activation.manager import install
from tunix_stage_plugin.activation.manager import installed_hooks
from tunix_stage_plugin.activation.manager import is_installed
from tunix_stage_plugin.activation.manager import uninstall
