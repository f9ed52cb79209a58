"""tunix-stage-plugin: stage tunix's training micro-batches on the device ahead of their turn.

Importing this package changes nothing in any host; see README.md for how staging is switched on.
"""

__version__ = "0.1.0"


def install(config=None, **kwargs):
  """Installs the staging hooks into tunix (see tunix_stage_plugin.activation.install)."""
  from tunix_stage_plugin.activation import manager  # lazy: importing the package stays free

  return manager.install(config, **kwargs)


def uninstall(host=None, **kwargs):
  """Removes the staging hooks exactly (see tunix_stage_plugin.activation.uninstall)."""
  from tunix_stage_plugin.activation import manager

  return manager.uninstall(host, **kwargs)
