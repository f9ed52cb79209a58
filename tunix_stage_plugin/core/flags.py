"""Driver flags for the staging settings, for argparse and absl drivers alike.

Flags default to "not given" so the environment, then the default, applies when a flag is
absent: flags beat env, env beats defaults (config.resolve). tunix's example drivers use
argparse; MaxText's use absl.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterable

from tunix_stage_plugin.core import config as config_lib

ORCHESTRATOR_FIELDS = config_lib.fields_for(config_lib.ORCHESTRATOR)
TRAINER_FIELDS = config_lib.fields_for(config_lib.TRAINER)
ALL_FIELDS = tuple(s.field for s in config_lib.SETTINGS)


def literal(text: str) -> str:
  """`text` as an argparse help string that shows it as written: argparse %-formats help (for
  %(default)s and the like), so a bare % in it would break --help."""
  return text.replace("%", "%%")


def _flag_help(setting: config_lib.Setting) -> str:
  return literal(f"{setting.help} Accepted: {setting.accepted}. Overrides ${setting.env}; "
                 f"default {setting.default}.")


def add_argparse_flags(parser: argparse.ArgumentParser,
                       fields: Iterable[str] = ALL_FIELDS) -> argparse.ArgumentParser:
  """Adds --stage_train_batches[=off|stage], --max_staged_batches N, ... to `parser`."""
  group = parser.add_argument_group("staging (tunix-stage-plugin)")
  for field in fields:
    s = config_lib.SETTINGS_BY_FIELD[field]
    if field == "mode":
      # A bare --stage_train_batches switches staging on, as a boolean driver flag would.
      group.add_argument(f"--{s.flag}", nargs="?", const=config_lib.MODE_STAGE, default=None,
                         metavar=s.metavar, help=_flag_help(s))
    else:
      group.add_argument(f"--{s.flag}", default=None, metavar=s.metavar, help=_flag_help(s))
  return parser


def config_from_argparse(args: argparse.Namespace,
                         fields: Iterable[str] = ALL_FIELDS) -> config_lib.StageConfig:
  """Resolves the configuration from parsed argparse flags plus the environment.

  `fields`: the ones whose flags add_argparse_flags added to the parser that made `args`.
  """
  explicit = {f: getattr(args, config_lib.SETTINGS_BY_FIELD[f].flag) for f in fields}
  return config_lib.resolve(explicit, explicit_source="flag")


def define_absl_flags(fields: Iterable[str] = ALL_FIELDS, flag_values: Any = None) -> None:
  """Registers the staging flags with absl (idempotent: already-defined flags are kept)."""
  from absl import flags  # absl is a runtime dependency, but only absl drivers need it here

  fv = flag_values if flag_values is not None else flags.FLAGS
  for field in fields:
    s = config_lib.SETTINGS_BY_FIELD[field]
    if s.flag in fv:
      continue
    if field == "mode":
      flags.DEFINE_enum(s.flag, None, list(config_lib.MODES), _flag_help(s), flag_values=fv)
    else:
      # The bounds refuse 0 (and a runaway value) when the command line is parsed; the value
      # then goes through the same parser as every other source (config_from_absl).
      flags.DEFINE_integer(s.flag, None, _flag_help(s), lower_bound=1,
                           upper_bound=config_lib.MAX_COUNT, flag_values=fv)


def config_from_absl(fields: Iterable[str] = ALL_FIELDS,
                     flag_values: Any = None) -> config_lib.StageConfig:
  """Resolves the configuration from parsed absl flags plus the environment (config.resolve)."""
  from absl import flags

  fv = flag_values if flag_values is not None else flags.FLAGS
  explicit = {f: fv[config_lib.SETTINGS_BY_FIELD[f].flag].value for f in fields
              if config_lib.SETTINGS_BY_FIELD[f].flag in fv}
  return config_lib.resolve(explicit, explicit_source="flag")


# One spelling for every flag of every command: underscores, as the hosts' drivers spell theirs
# (tunix's argparse drivers and MaxText's absl flags: --stage_train_batches sits on their command
# lines next to ours). The dashed spelling is accepted as an alias; so are the old names below.
OLD_NAMES = {
    "max_device_batches": "stage_max_device_batches",
    "max_host_batches": "stage_max_host_batches",
}


class Parser(argparse.ArgumentParser):
  """argparse with the plugin's flag spelling: --a_b canonical, --a-b and OLD_NAMES accepted.

  Only this parser's own long options are rewritten, and nothing after a bare `--` (a command
  given to `tunix-stage run` keeps its flags as written). Subcommand parsers are Parsers too.
  """

  def _canonical(self, token: str) -> str:
    if not token.startswith("--") or token == "--":
      return token
    name, sep, value = token[2:].partition("=")
    spelled = name.replace("-", "_")
    spelled = OLD_NAMES.get(spelled, spelled)
    if f"--{name}" in self._option_string_actions or f"--{spelled}" not in self._option_string_actions:
      return token
    return f"--{spelled}{sep}{value}"

  def parse_known_args(self, args=None, namespace=None):
    tokens = list(sys.argv[1:] if args is None else args)
    cut = tokens.index("--") if "--" in tokens else len(tokens)
    tokens = [self._canonical(t) for t in tokens[:cut]] + tokens[cut:]
    return super().parse_known_args(tokens, namespace)
