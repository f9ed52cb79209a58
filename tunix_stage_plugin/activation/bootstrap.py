"""The env-gated bootstrap that `tunix_stage_plugin.pth` runs at interpreter start.

With staging on, `start` registers each known host's install to run when that host's modules are
first imported, and does nothing else (no validation, no entry points, no metadata); the
configuration is resolved, and an invalid value stops the process, only when the host is imported
(manager.activate_from_env). docs/tunix.md "Activation, three ways". Nothing here may raise at
start-up: a .pth line that raises prints a traceback into every Python process.
"""

from __future__ import annotations

import os
import sys

ENV = "TUNIX_STAGE_BATCH"
# The exact line shipped in tunix_stage_plugin.pth (tests compare the file against it).
PTH_LINE = (f"import os; os.environ.get({ENV!r}, '').strip() not in ('', 'off') and "
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
  # Imported here, not at the top, so the module stays importable in a broken environment.
  from tunix_stage_plugin.hosts import triggers
  from tunix_stage_plugin.activation import importhook

  if os.environ.get(ENV, "").strip() in ("", "off"):
    return
  for host, modules in triggers.HOST_TRIGGERS.items():
    importhook.when_imported(modules, lambda host=host: _activate(host))
  # A known driver takes the staging flags once imported (after its host's hooks, when they fire
  # on the same import), even where the host's hooks are refused (activation/drivers.py).
  for driver in triggers.KNOWN_DRIVERS:
    if driver.parse is not None:
      importhook.when_imported((driver.module,), lambda driver=driver: _hook_driver(driver))


def _activate(host: str) -> None:
  """Runs once the host is imported: resolve, then install; exit 2 on an invalid setting."""
  from tunix_stage_plugin.activation import manager  # pylint: disable=import-outside-toplevel

  manager.activate_from_env(host)


def _hook_driver(driver: triggers.Driver) -> None:
  from tunix_stage_plugin.activation import manager  # pylint: disable=import-outside-toplevel

  manager.hook_driver(driver)


PTH_NAME = "tunix_stage_plugin.pth"


def installed_pth_files() -> list[str]:
  """The bootstrap .pth files this interpreter's site directories hold (doctor, run)."""
  import site  # pylint: disable=import-outside-toplevel

  dirs = list(site.getsitepackages())
  if site.ENABLE_USER_SITE:
    dirs.append(site.getusersitepackages())
  return [path for path in (os.path.join(d, PTH_NAME) for d in dirs) if os.path.isfile(path)]
