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


SETTING_FLAGS = frozenset(f"--{s.flag}" for s in config_lib.SETTINGS)


def _value_flag(parser: argparse.ArgumentParser, token: str) -> str | None:
  """The staging flag that `token` names on `parser` and that always takes one value (every one
  but --stage_train_batches, whose value is optional), or None. An abbreviation counts where the
  parser takes them and it names one option only, as argparse reads it."""
  options = parser._option_string_actions  # pylint: disable=protected-access  (no public map)
  if token in options:
    found = [token]
  elif parser.allow_abbrev and token.startswith("--") and len(token) > 2:
    found = [o for o in options if o.startswith(token)]
  else:
    return None
  if len(found) != 1 or found[0] not in SETTING_FLAGS or options[found[0]].nargs is not None:
    return None
  return found[0]


def join_values(parser: argparse.ArgumentParser, tokens: list[str]) -> list[str]:
  """`tokens` with each `--flag VALUE` of a staging flag that takes a value as `--flag=VALUE`
  where VALUE begins with '-': argparse takes such a word for an option and says only "expected
  one argument", so `--stage_memory_budget -1GiB` would never reach the setting's own check (as
  `--stage_memory_budget=-1GiB` does). `tokens` ends before a bare `--`. --stage_train_batches is
  left alone: bare, it means stage (as a boolean driver flag), so a word after it that begins with
  '-' is the next option; its value goes after '='."""
  joined: list[str] = []
  i = 0
  while i < len(tokens):
    token = tokens[i]
    if i + 1 < len(tokens) and tokens[i + 1].startswith("-") and _value_flag(parser, token):
      joined.append(f"{token}={tokens[i + 1]}")
      i += 2
    else:
      joined.append(token)
      i += 1
  return joined


def _split(args: Iterable[str] | None) -> tuple[list[str], list[str]]:
  """The command line's words before a bare `--`, and the rest (from `--` on)."""
  tokens = list(sys.argv[1:] if args is None else args)
  cut = tokens.index("--") if "--" in tokens else len(tokens)
  return tokens[:cut], tokens[cut:]


def _join_on(parser: argparse.ArgumentParser) -> None:
  """A parser of the driver's own (not a Parser) joins the staging flags' values too: its
  parse_known_args, which parse_args calls, is wrapped on this instance only."""
  if isinstance(parser, Parser) or getattr(parser, "_tunix_stage_joins", False):
    return
  parse_known_args = parser.parse_known_args

  def joining(args=None, namespace=None):
    head, rest = _split(args)
    return parse_known_args(join_values(parser, head) + rest, namespace)

  parser.parse_known_args = joining  # type: ignore[method-assign]
  parser._tunix_stage_joins = True  # pylint: disable=protected-access


def add_argparse_flags(parser: argparse.ArgumentParser,
                       fields: Iterable[str] = ALL_FIELDS) -> argparse.ArgumentParser:
  """Adds --stage_train_batches[=off|stage], --max_staged_batches N, ... to `parser`; a value
  that begins with '-' reaches the setting's own check in either spelling (join_values)."""
  _join_on(parser)
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
  given to `tunix-stage run` keeps its flags as written). Subcommand parsers are Parsers too. A
  staging flag's value that begins with '-' is joined to its flag (join_values).
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
    head, rest = _split(args)
    head = join_values(self, [self._canonical(t) for t in head])
    for token in head:
      name, _, value = token.partition("=")
      if value == "--" and name in self._option_string_actions:
        # argparse drops a value of exactly "--" (it ends the options) and hands the option an
        # empty list: refused here, in the settings' error shape.
        self.error(inputs.invalid(name, value, "a value other than '--', which ends the options"))
    return super().parse_known_args(head + rest, namespace)
