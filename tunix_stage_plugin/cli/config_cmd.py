"""`tunix-stage config`: the effective staging configuration and where each value came from.

Its output modes (--check, --json, --env_for, --flags_for) exclude each other, and --driver goes
alone or with --flags_for, so no flag given is silently ignored. A variable under the staging
prefixes that is no setting gets one warning from the views of the environment (the table,
--json, --check: what a launch recipe validates with); --env_for, --flags_for and --driver, which
scripts ask after --check, do not repeat it (docs/configuration.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tunix_stage_plugin.hosts import triggers
from tunix_stage_plugin.hosts.triggers import KNOWN_DRIVERS
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib
from tunix_stage_plugin.core import inputs


def add_parser(subparsers: argparse._SubParsersAction) -> None:
  parser = subparsers.add_parser(
      "config",
      help="print the effective staging configuration",
      description="Print the effective staging configuration: each value, and whether it came "
      "from a flag, the environment or the default (flags beat env, env beats defaults). "
      "Exits 2 when a value is invalid, with one line per invalid variable.",
      epilog="environment:\n" + "\n".join(f"  {s.env:32s} {s.help}" for s in config_lib.SETTINGS),
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  flags_lib.add_argparse_flags(parser)
  parser.add_argument("--json", action="store_true", help="print JSON for machines")
  parser.add_argument("--check", action="store_true",
                      help="print nothing on stdout; exit 0 when valid, 2 with the errors (on "
                      "stderr, as warnings are) otherwise")
  parser.add_argument("--env_for", metavar="ROLE",
                      help="print NAME=value, one per line, for the variables a process of ROLE "
                      f"({' | '.join(config_lib.ROLES)}) reads (what its container gets)")
  parser.add_argument("--flags_for", metavar="ROLE",
                      help="print --flag=value, one per line, for ROLE's settings when staging is "
                      "on (nothing when it is off; the codec only when set)")
  parser.add_argument("--driver", metavar="MAIN",
                      help="the driver that gets the flags (a module, or its main as a runtime's "
                      "--process_main names it): with --flags_for, print them only when MAIN is "
                      "a driver known to take them (the launch recipes pass them to no other); "
                      "alone, say whether it takes them")
  parser.set_defaults(run=run)


def driver_line(main: str) -> str:
  """One line: whether the driver `main` names takes the staging flags, and how."""
  driver = triggers.find(main)
  if driver is None:
    return (f"{main}: not a driver known to take the staging flags; it reads the staging "
            "settings from the environment only (known: "
            + ", ".join(d.module for d in KNOWN_DRIVERS) + ")")
  how = ("its own flags" if driver.parse is None else
         f"the plugin adds them to its {driver.parse} when staging is on")
  return f"{main}: takes the staging flags: {driver.about}, {how}"


def print_config_error(command: str, error: config_lib.ConfigError) -> int:
  """Prints one "tunix-stage COMMAND: error: ..." line per bad setting; returns exit code 2."""
  for problem in error.problems:
    print(f"tunix-stage {command}: error: {problem}", file=sys.stderr)
  return 2


def warn_unknown_variables(command: str) -> list[str]:
  """One "tunix-stage COMMAND: warning: ..." line on stderr per unknown staging-like variable in
  the environment (config.unknown_variables); returns their texts."""
  lines = config_lib.unknown_variable_lines()
  for line in lines:
    print(f"tunix-stage {command}: warning: {line}", file=sys.stderr)
  return lines


OUTPUTS = ("check", "json", "env_for", "flags_for")  # what config prints: one at most


def _usage_problems(args: argparse.Namespace) -> list[str]:
  """The flags that would be ignored or cannot be honoured, one line each."""
  problems = []
  roles = " | ".join(config_lib.ROLES)
  for flag in ("env_for", "flags_for"):
    value = getattr(args, flag)
    if value is not None and value not in config_lib.ROLES:
      problems.append(inputs.invalid(f"--{flag}", value, roles))
  given = [f"--{name}" for name in OUTPUTS if getattr(args, name) not in (None, False)]
  if len(given) > 1:
    problems.append(inputs.invalid(given[1], None, f"one of {', '.join('--' + o for o in OUTPUTS)}",
                                   f"{given[0]} is given too, and each prints something else"))
  elif args.driver is not None and given and given[0] != "--flags_for":
    problems.append(inputs.invalid("--driver", args.driver, "--driver alone, or with --flags_for",
                                   f"{given[0]} does not read it"))
  return problems


def run(args: argparse.Namespace) -> int:
  if not (args.env_for or args.flags_for or args.driver):  # (scripts ask those after --check)
    warn_unknown_variables("config")
  problems = _usage_problems(args)
  try:
    cfg = flags_lib.config_from_argparse(args)
  except config_lib.ConfigError as e:
    problems = e.problems + problems
  if problems:
    return print_config_error("config", config_lib.ConfigError(*problems))
  if args.check:
    return 0
  if args.driver is not None and not args.flags_for:
    print(driver_line(args.driver))
    return 0
  if args.env_for or args.flags_for:
    role = args.env_for or args.flags_for
    if args.flags_for and args.driver is not None and triggers.find(args.driver) is None:
      return 0  # a driver the plugin does not know: the environment only
    for field in config_lib.fields_for(role):
      setting, value = config_lib.SETTINGS_BY_FIELD[field], getattr(cfg, field)
      if args.env_for:
        if not (setting.default_note and cfg.sources[field] == config_lib.SOURCE_DEFAULT):
          print(f"{setting.env}={value}")  # (a machine's own default: that machine derives it)
      elif cfg.enabled and (setting.flag_at_default or value != setting.default):
        print(f"--{setting.flag}={value}")
    return 0
  if args.json:
    print(json.dumps({"enabled": cfg.enabled, "settings": cfg.as_dict()}, indent=2))
    return 0
  for item in cfg.as_dict().values():
    print(setting_row(item))
  return 0


def setting_row(item: dict[str, Any]) -> str:
  """One row of the settings table (`config`, and `doctor`'s): variable, value, its source."""
  return f"{item['env']:32s} {config_lib.shown(item['value']):8s} ({item['source']})"
