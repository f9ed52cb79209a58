"""install / uninstall: one activation per host per process, idempotent and exactly reversible.

`install` resolves the settings (off touches nothing), loads the host, runs every probe, and only
when all pass applies the hooks through a registry that records what each class had. Its one
line goes to stderr: a pod's stdout is often the training log. An invalid setting is a
ConfigError, never a refusal. `hook_driver` gives a known driver the staging flags.
docs/tunix.md "Activation, three ways".
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
from typing import TYPE_CHECKING

from tunix_stage_plugin.activation import entry_points
from tunix_stage_plugin.hosts import triggers
from tunix_stage_plugin.activation import importhook
from tunix_stage_plugin.core import patching
from tunix_stage_plugin.core import config as config_lib

if TYPE_CHECKING:  # the adapters' contract: typing only
  from tunix_stage_plugin.hosts import interface as hosts_lib

DEFAULT_HOST = "tunix"


@dataclasses.dataclass
class Activation:
  """What `install` did (or why it did nothing)."""

  host: str
  installed: bool
  line: str  # the one-line report
  hooks: list[str] = dataclasses.field(default_factory=list)
  config: config_lib.StageConfig | None = None


@dataclasses.dataclass
class _Active:
  adapter: hosts_lib.HostAdapter
  registry: patching.PatchRegistry
  live: config_lib.LiveConfig  # what the hooks read; handed down to them at apply
  line: str


_lock = threading.RLock()  # re-entrant: install imports host modules, which may fire the bootstrap
_active: dict[str, _Active] = {}
# Driver module -> (its host, the registry that set its parse function).
_driver_hooks: dict[str, tuple[str, patching.PatchRegistry]] = {}
_watched_drivers: set[str] = set()  # driver modules a post-import watch waits for
_left_drivers: set[str] = set()  # driver modules left as they are (said once)


def _say(line: str, quiet: bool) -> None:
  if not quiet:
    print(line, file=sys.stderr, flush=True)


def install(config: config_lib.StageConfig | None = None, *, host: str = DEFAULT_HOST,
            quiet: bool = False, **settings: object) -> Activation:
  """Installs the staging hooks into `host` when the configuration says `stage`.

  Args:
    config: the configuration to run with; resolved from the environment when None. Calling
      install again with a new enabled config updates the depths without re-patching.
    host: the entry-point name of the host adapter.
    quiet: print nothing (the returned Activation still carries the line).
    **settings: explicit settings by field name (mode="stage", max_staged_batches=2, ...; the
      table in config.SETTINGS): they beat the environment, which beats the defaults. Not
      together with `config`.

  Raises:
    config_lib.ConfigError: a setting is unknown or invalid, or `config` is None and a staging
      variable in the environment is invalid (every invalid one is named); nothing is installed.
    TypeError: both `config` and settings are given.
  """
  if config is not None and settings:
    raise TypeError(f"install() takes a config or settings ({', '.join(sorted(settings))}), "
                    "not both")
  with _lock:
    config = config_lib.resolve(settings, explicit_source=config_lib.SOURCE_INSTALL) if config is None else config
    if not config.enabled:
      if host in _active:
        return _refuse(host, f"staging is off ({_mode_origin(config)}) but hooks are installed; "
                       "call uninstall() to remove them", quiet, installed=True)
      return _refuse(host, f"staging is off ({_mode_origin(config)}); nothing installed", quiet)
    _warn_unknown_variables(quiet)
    current = _active.get(host)
    if current is not None:
      changed = current.live.config != config  # values only: sources do not compare
      current.live.update(config)  # idempotent: same hooks, the new depths (live objects too)
      if changed:
        _say(f"tunix-stage: staging settings now in force for {host}: {_settings(config)}",
             quiet)
      return Activation(host, True, current.line, current.registry.names(), config)
    try:
      adapter = entry_points.load_adapter(host)
      adapter.load()
    except ImportError as e:
      return _refuse(host, f"{host} is not importable ({type(e).__name__}: {e})", quiet)
    except LookupError as e:
      return _refuse(host, str(e), quiet)
    current = _active.get(host)
    if current is not None:
      # Loading the host imported what the .pth bootstrap waits for, and its install (nested,
      # on this thread) installed the host: this call's work is done, not a host to refuse.
      current.live.update(config)
      return Activation(host, True, current.line, current.registry.names(), config)
    failed = [p for p in adapter.probe(config) if not p.ok]
    if failed:
      reasons = "; ".join(f"{p.name}: {p.detail}" for p in failed)
      return _refuse(host, f"{adapter.describe()} does not match ({reasons})", quiet)
    registry = patching.PatchRegistry()
    live = config_lib.LiveConfig(config)
    try:
      adapter.apply(registry, live)
    except Exception as e:  # pylint: disable=broad-except  (leave the host as it was, then say why)
      patching.report_problems(registry.undo())
      return _refuse(host, f"applying hooks failed, all reverted: {type(e).__name__}: {e}", quiet)
    line = (f"tunix-stage: staging on for {adapter.describe()}: {len(registry.names())} hooks "
            f"({', '.join(adapter.hook_groups)}); {_settings(config, DEPTHS)}")
    _active[host] = _Active(adapter, registry, live, line)
    _say(line, quiet)
    accept_driver_flags(host)
    return Activation(host, True, line, registry.names(), config)


_warned_variables: set[str] = set()  # unknown variables warned about in this process


def _warn_unknown_variables(quiet: bool) -> None:
  """One warning per variable under the staging prefixes that is no setting (a likely typo),
  once per process that activates staging; never an error, since another tool may own the name.
  Only here, where staging is requested: with staging off nothing of the plugin runs."""
  for name, closest in config_lib.unknown_variables():
    if name not in _warned_variables:
      _warned_variables.add(name)
      _say(f"tunix-stage: warning: {config_lib.unknown_variable_line(name, closest)}", quiet)


def activate_from_env(host: str = DEFAULT_HOST) -> Activation | None:
  """The automatic activation (bootstrap, native entry point): the environment decides.

  Silent when staging is off; installs when it is on. An invalid setting prints one line per bad
  variable, "tunix-stage: error: invalid staging configuration: NAME='value' is invalid;
  accepted: ...", and raises SystemExit(2), so the process stops before any work starts.
  SystemExit rather than ConfigError: it ends the process with the same status as `tunix-stage
  config --check` and without a traceback, and the host's `except Exception` around an optional
  import cannot swallow it into a silent no-op.
  """
  try:
    config = config_lib.resolve()
  except config_lib.ConfigError as e:
    for problem in e.problems:
      print(f"tunix-stage: error: invalid staging configuration: {problem}", file=sys.stderr,
            flush=True)
    raise SystemExit(2) from None
  if not config.enabled:
    return None
  _say_script_driver(host)  # said whether or not the host's hooks install
  return install(config, host=host)


# The settings the activation line names (the codec has its own line where it is on).
DEPTHS = ("max_staged_batches", "max_device_batches", "max_host_batches")


def _origin(config: config_lib.StageConfig, field: str) -> str:
  """Where `field`'s value came from: its variable, its flag, install() or the default."""
  setting = config_lib.SETTINGS_BY_FIELD[field]
  return {config_lib.SOURCE_ENV: setting.env, config_lib.SOURCE_DEFAULT: "default",
          config_lib.SOURCE_INSTALL: f"install({field})"}.get(config.sources[field],
                                                              f"--{setting.flag}")


def _mode_origin(config: config_lib.StageConfig) -> str:
  return f"{_origin(config, 'mode')}={config.mode}"


def _settings(config: config_lib.StageConfig,
              fields: tuple[str, ...] = (*DEPTHS, "codec")) -> str:
  """The values in force, each not at its default with where it came from, then the mode's
  origin: 'max_staged_batches=3 (--max_staged_batches), max_device_batches=1, ...
  [TUNIX_STAGE_BATCH=stage]'."""
  values = ", ".join(
      f"{f}={getattr(config, f)}" + ("" if config.sources[f] == config_lib.SOURCE_DEFAULT
                                    else f" ({_origin(config, f)})") for f in fields)
  return f"{values} [{_mode_origin(config)}]"


def _refuse(host: str, reason: str, quiet: bool, *, installed: bool = False) -> Activation:
  line = f"tunix-stage: {reason}"
  _say(line, quiet)
  return Activation(host, installed, line)


def configure(config: config_lib.StageConfig, *, host: str = DEFAULT_HOST,
              quiet: bool = False) -> Activation:
  """Makes this process match `config`, e.g. from driver flags (which beat the environment).

  Enabled: installs, or updates the depths of hooks the bootstrap already installed. Off: removes
  hooks the bootstrap installed from TUNIX_STAGE_BATCH=stage (install alone never removes any).
  """
  with _lock:
    config = _keep_install_settings(config, host)
    if not config.enabled and host in _active:
      uninstall(host, quiet=True)
      return _refuse(host, f"staging is off ({_mode_origin(config)}); hooks removed", quiet)
    return install(config, host=host, quiet=quiet)


def _keep_install_settings(config: config_lib.StageConfig, host: str) -> config_lib.StageConfig:
  """Settings given to install(...) beat the environment and defaults in `config` (flags > explicit
  > env > default): the driver's resolution does not know them."""
  active = _active.get(host)
  if active is None:
    return config
  current = active.live.config
  kept = {f: getattr(current, f) for f, source in current.sources.items()
          if source == config_lib.SOURCE_INSTALL
          and config.sources[f] in (config_lib.SOURCE_ENV, config_lib.SOURCE_DEFAULT)}
  if not kept:
    return config
  sources = {**config.sources, **{f: config_lib.SOURCE_INSTALL for f in kept}}
  return dataclasses.replace(config, **kept, sources=sources)


def uninstall(host: str | None = None, *, quiet: bool = False) -> list[str]:
  """Removes the hooks of `host` (all hosts when None), its drivers' flags included; returns the
  hosts it uninstalled."""
  with _lock:
    for module, (driver_host, registry) in list(_driver_hooks.items()):
      if host in (None, driver_host):
        del _driver_hooks[module]
        patching.report_problems(registry.undo())
    hosts = list(_active) if host is None else [h for h in (host,) if h in _active]
    for h in hosts:
      patching.report_problems(_active.pop(h).registry.undo())
      _say(f"tunix-stage: staging hooks removed from {h}", quiet)
    return hosts


def _requested(host: str) -> bool:
  """Staging is requested for `host` in this process: its hooks are installed, or the environment
  asks for it (the host's hooks may still have been refused)."""
  setting = config_lib.SETTINGS_BY_FIELD["mode"]
  return host in _active or os.environ.get(setting.env, "").strip() == config_lib.MODE_STAGE


def accept_driver_flags(host: str) -> None:
  """`host`'s known drivers take the staging flags: one imported already at once, the others when
  they are imported (one post-import watch per driver and process). A known driver run as a
  script (`python -m DRIVER`) is `__main__`, whose parse function is defined after the imports
  that install staging: it cannot take the flags, and one line says so."""
  _say_script_driver(host)
  for driver in triggers.hooked(host):
    if driver.module in sys.modules:
      hook_driver(driver)
    elif driver.module not in _watched_drivers:
      _watched_drivers.add(driver.module)
      importhook.when_imported((driver.module,), functools.partial(hook_driver, driver))


def _say_script_driver(host: str) -> None:
  spec = vars(sys.modules["__main__"]).get("__spec__")  # None: a script file, -c or interactive
  driver = None if spec is None else triggers.find(spec.name)
  if driver is None or driver not in triggers.hooked(host) or driver.module in _left_drivers:
    return
  _left_drivers.add(driver.module)
  print(f"tunix-stage: {driver.module} runs as a script (python -m), so its command line takes "
        "no staging flag (--stage_train_batches, --max_staged_batches, ...); set the staging "
        "variables (TUNIX_STAGE_BATCH, TUNIX_MAX_STAGED_BATCHES) instead, or launch it by name "
        f"as tunix's runtime does (--process_main={driver.module}.main)", file=sys.stderr,
        flush=True)


def hook_driver(driver: triggers.Driver) -> None:
  """Makes the imported `driver` take the staging flags, while staging is requested for its host
  (once; a driver of another shape gets nothing and one line saying so)."""
  with _lock:
    if (driver.module in _driver_hooks or driver.module in _left_drivers
        or not _requested(driver.host)):
      return
    module = sys.modules[driver.module]
    # The flags' wrapper (drivers.py, with core/flags.py), loaded once a known driver is.
    from tunix_stage_plugin.activation import drivers  # pylint: disable=import-outside-toplevel
    if drivers.defines_flags(module, driver):
      _left_drivers.add(driver.module)
      return  # the driver defines them itself (the upstream change): nothing to add
    problem = drivers.problem(module, driver)
    if problem is not None:
      _left_drivers.add(driver.module)
      print(f"tunix-stage: {problem}; the driver takes no staging flag and reads the staging "
            "settings from the environment only", file=sys.stderr, flush=True)
      return
    registry = patching.PatchRegistry()
    registry.set(module, driver.parse, drivers.accepting_flags(vars(module)[driver.parse], driver,
                                                         configure))
    _driver_hooks[driver.module] = (driver.host, registry)


def hooked_drivers() -> list[str]:
  """The driver modules whose parse function takes the staging flags in this process."""
  return sorted(_driver_hooks)


def current_config(host: str = DEFAULT_HOST) -> config_lib.StageConfig:
  """The configuration the installed hooks run with; raises when `host` is not installed."""
  active = _active.get(host)
  if active is None:
    raise RuntimeError(f"tunix-stage hooks for {host!r} are not installed")
  return active.live.config


def installed_hooks(host: str = DEFAULT_HOST) -> list[str]:
  active = _active.get(host)
  return [] if active is None else active.registry.names()


def is_installed(host: str = DEFAULT_HOST) -> bool:
  return host in _active
