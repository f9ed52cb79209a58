"""Driver flags for the staging settings (argparse, as tunix's drivers parse theirs).

Flags default to "not given" so the environment, then the default, applies when a flag is
absent: flags beat env, env beats defaults (config.resolve). docs/configuration.md.
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterable

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import inputs

ORCHESTRATOR_FIELDS = config_lib.fields_for(config_lib.ORCHESTRATOR)
TRAINER_FIELDS = config_lib.fields_for(config_lib.TRAINER)
ALL_FIELDS = tuple(s.field for s in config_lib.SETTINGS)


def literal(text: str) -> str:
  """`text` as an argparse help string that shows it as written: argparse %-formats help (for
  %(default)s and the like), so a bare % in it would break --help."""
  return text.replace("%", "%%")


def _flag_help(setting: config_lib.Setting) -> str:
  return literal(f"{setting.help} Accepted: {setting.accepted}. Overrides ${setting.env}; "
                 f"default {setting.default_note or config_lib.shown(setting.default)}.")


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


class Parser(argparse.ArgumentParser):
  """argparse with the plugin's flag spelling: --a_b canonical, --a-b accepted.

  One spelling for every flag of every command: underscores, as the hosts' drivers spell theirs
  (tunix's argparse drivers: --stage_train_batches sits on their command lines next to ours).

  Only this parser's own long options are rewritten, and nothing after a bare `--` (a command
  given to `tunix-stage run` keeps its flags as written). Subcommand parsers are Parsers too.
  """

  def _canonical(self, token: str) -> str:
    if not token.startswith("--") or token == "--":
      return token
    name, sep, value = token[2:].partition("=")
    spelled = name.replace("-", "_")
    if f"--{name}" in self._option_string_actions or f"--{spelled}" not in self._option_string_actions:
      return token
    return f"--{spelled}{sep}{value}"

  def parse_known_args(self, args=None, namespace=None):
    tokens = list(sys.argv[1:] if args is None else args)
    cut = tokens.index("--") if "--" in tokens else len(tokens)
    tokens = [self._canonical(t) for t in tokens[:cut]] + tokens[cut:]
    for token in tokens[:cut]:
      name, _, value = token.partition("=")
      if value == "--" and name in self._option_string_actions:
        # argparse drops a value of exactly "--" (it ends the options) and hands the option an
        # empty list: refused here, in the settings' error shape.
        self.error(inputs.invalid(name, value, "a value other than '--', which ends the options"))
    return super().parse_known_args(tokens, namespace)
