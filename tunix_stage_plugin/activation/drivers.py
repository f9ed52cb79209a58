"""Driver flags without editing the driver: a known driver's parse function takes the staging flags.

tunix's drivers parse with a plain argparse `_parse_args(argv)` that defines no staging flag, so
the recipes' flags would stop them at "unrecognized arguments". `accepting_flags(...)` becomes such
a driver's parse function (through a patch registry of its own, reversed on uninstall): it takes
the staging flags off the command line, hands every other argument to the driver's parser
unchanged, puts the effective values on the namespace (flags > environment > default) and applies
them (activation.configure). The drivers: triggers.KNOWN_DRIVERS. docs/tunix.md "Driver flags".
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any, Callable

from tunix_stage_plugin.hosts import probing
from tunix_stage_plugin.hosts import triggers
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib

Driver = triggers.Driver
FIELDS = flags_lib.ORCHESTRATOR_FIELDS  # the drivers are orchestrator drivers
# A driver whose parse function defines this flag (add_argument) defines the staging flags itself.
NATIVE_MARK = config_lib.SETTINGS_BY_FIELD["mode"].flag


def problem(module: types.ModuleType, driver: Driver) -> str | None:
  """Why `module`'s parse function cannot be made to take the staging flags (None: it can)."""
  parse = vars(module).get(driver.parse)
  where = f"{driver.module}.{driver.parse}"
  if not isinstance(parse, types.FunctionType):
    return f"{where} is {'missing' if parse is None else type(parse).__name__ + ', not a function'}"
  params = list(inspect.signature(parse).parameters.values())
  if len(params) != 1 or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                inspect.Parameter.POSITIONAL_OR_KEYWORD):
    return f"{where}{inspect.signature(parse)} is not {driver.parse}(argv)"
  return None


def defines_flags(module: types.ModuleType, driver: Driver) -> bool:
  """Whether the driver's parse function defines the staging flags itself (the upstream change
  merged): its parsed code passes the flag to an `add_argument` call. Then it needs nothing from
  the plugin."""
  parse = vars(module).get(driver.parse)
  if not isinstance(parse, types.FunctionType):
    return False
  try:
    return f"--{NATIVE_MARK}" in probing.Body(parse).string_arguments("add_argument")
  except OSError:  # no source to read (e.g. bytecode only): not known to define them
    return False


def staging_parser(driver: Driver) -> flags_lib.Parser:
  """The staging flags alone: exact names (no abbreviation), no --help of their own."""
  parser = flags_lib.Parser(prog=driver.module, add_help=False, allow_abbrev=False,
                            usage=f"{driver.module} [driver flags] [staging flags]")
  return flags_lib.add_argparse_flags(parser, FIELDS)


def accepting_flags(parse: Callable[[Any], Any], driver: Driver,
                    configure: Callable[..., Any]) -> Callable[[Any], Any]:
  """`parse` (the driver's own `_parse_args(argv)`), also taking the staging flags; the effective
  configuration goes to `configure(config, host=...)` (the manager's)."""

  @functools.wraps(parse)
  def parse_with_staging_flags(argv: Any) -> Any:
    staging = staging_parser(driver)
    tokens = sys.argv[1:] if argv is None else list(argv)
    given, rest = staging.parse_known_args(tokens)  # every other argument, in order, untouched
    try:
      config = flags_lib.config_from_argparse(given, FIELDS)
    except config_lib.ConfigError as e:  # one line per bad setting, as the driver's own errors
      for line in e.problems:
        print(f"{driver.module}: error: {line}", file=sys.stderr)
      raise SystemExit(2) from None
    try:
      args = parse(rest)
    except SystemExit as e:
      if e.code in (0, None) and {"-h", "--help"} & set(rest):  # the driver printed its help
        print(staging.format_help(), end="")
      raise
    for field in FIELDS:  # the effective values, on the namespace the driver works from
      setattr(args, config_lib.SETTINGS_BY_FIELD[field].flag, getattr(config, field))
    configure(config, host=driver.host)
    return args

  return parse_with_staging_flags
