"""The env-gated bootstrap that `tunix_stage_plugin.pth` runs at interpreter start.

The .pth line itself checks TUNIX_STAGE_BATCH before importing anything, so with staging off
(the default) interpreter start-up costs one dict lookup. With TUNIX_STAGE_BATCH=stage, `start`
registers each host adapter's install to run when that host's modules are first imported.
Nothing here may raise: a .pth line that raises prints a traceback into every Python process.
"""

from __future__ import annotations

import os
import sys

ENV = "TUNIX_STAGE_BATCH"
# The exact line shipped in tunix_stage_plugin.pth (tests compare the file against it).
PTH_LINE = (f"import os; os.environ.get({ENV!r}, '').strip() == 'stage' and "
            "__import__('tunix_stage_plugin.activation.bootstrap', fromlist=['start']).start()")

_started = False


def start() -> None:
  """Registers the post-import installs; idempotent; prints one line on any problem."""
  global _started
  if _started:
    return
  _started = True
  try:
    _start()
  except Exception as e:  # pylint: disable=broad-except  (see module docstring)
    print(f"tunix-stage: bootstrap failed, nothing installed: {type(e).__name__}: {e}",
          file=sys.stderr)


def _start() -> None:
  # Imported here, not at the top, so the module stays importable in a broken environment and the
  # off path (which never gets here) imports nothing.
  from tunix_stage_plugin.activation import entry_points
  from tunix_stage_plugin.activation import importhook
  from tunix_stage_plugin.activation import manager
  from tunix_stage_plugin.core import config as config_lib

  if os.environ.get(ENV, "").strip() != config_lib.MODE_STAGE:
    return
  try:
    config_lib.resolve()  # a bad depth is reported now, once, not at the first host import
  except config_lib.ConfigError as e:
    print(f"tunix-stage: invalid staging configuration, nothing installed: {e}", file=sys.stderr)
    return
  for name, adapter in entry_points.load_adapters().items():
    importhook.when_imported(adapter.trigger_modules,
                             lambda name=name: manager.install(host=name))


PTH_NAME = "tunix_stage_plugin.pth"


def installed_pth_files() -> list[str]:
  """The bootstrap .pth files this interpreter's site directories hold (doctor, run)."""
  import site  # pylint: disable=import-outside-toplevel

  dirs = list(site.getsitepackages())
  if site.ENABLE_USER_SITE:
    dirs.append(site.getusersitepackages())
  return [path for path in (os.path.join(d, PTH_NAME) for d in dirs) if os.path.isfile(path)]
