"""Staging configuration: one table of settings, resolved as explicit > env > default.

Every consumer (the CLI, the driver flags, the launch recipes through `tunix-stage config
--check`) goes through `resolve`, so a value is validated by exactly one set of rules and a bad one
gives exactly one error naming the variable, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

MODE_OFF = "off"
MODE_STAGE = "stage"
MODES = (MODE_OFF, MODE_STAGE)

SOURCE_DEFAULT = "default"
SOURCE_ENV = "env"


class ConfigError(ValueError):
  """A staging setting has a value outside what it accepts."""


def _parse_mode(text: str) -> str:
  value = text.strip()
  if value not in MODES:
    raise ValueError(f"accepted: {' | '.join(MODES)}")
  return value


def _parse_positive_int(text: str) -> int:
  value = text.strip()
  # int() alone would take "+2", " 2", "2_0" and "٢"; a count in an env var is plain ASCII digits.
  if not (value.isascii() and value.isdigit()) or int(value) < 1:
    raise ValueError("accepted: an integer >= 1")
  return int(value)


@dataclasses.dataclass(frozen=True)
class Setting:
  """One knob: its field name, env variable, driver flag, default and parser."""

  field: str
  env: str
  flag: str
  default: Any
  parse: Callable[[str], Any]
  help: str


SETTINGS: tuple[Setting, ...] = (
    Setting(
        field="mode",
        env="TUNIX_STAGE_BATCH",
        flag="stage_train_batches",
        default=MODE_OFF,
        parse=_parse_mode,
        help="off: the host runs exactly as without the plugin; stage: micro-batches are staged "
        "on the trainer's device ahead of their train call.",
    ),
    Setting(
        field="max_staged_batches",
        env="TUNIX_MAX_STAGED_BATCHES",
        flag="max_staged_batches",
        default=2,
        parse=_parse_positive_int,
        help="orchestrator: how many micro-batches to keep staged ahead of the pending train call.",
    ),
    Setting(
        field="max_device_batches",
        env="TUNIX_STAGE_MAX_DEVICE_BATCHES",
        flag="stage_max_device_batches",
        default=1,
        parse=_parse_positive_int,
        help="trainer: how many staged batches may sit in device memory at once; a stage over "
        "the bound is refused and that micro-batch trains inline.",
    ),
)
SETTINGS_BY_FIELD = {s.field: s for s in SETTINGS}


@dataclasses.dataclass(frozen=True)
class StageConfig:
  """The effective configuration and, per field, where its value came from."""

  mode: str = MODE_OFF
  max_staged_batches: int = 2
  max_device_batches: int = 1
  sources: Mapping[str, str] = dataclasses.field(
      default_factory=lambda: {s.field: SOURCE_DEFAULT for s in SETTINGS}, compare=False
  )

  @property
  def enabled(self) -> bool:
    return self.mode == MODE_STAGE

  def as_dict(self) -> dict[str, dict[str, Any]]:
    return {
        s.field: {"value": getattr(self, s.field), "source": self.sources[s.field], "env": s.env}
        for s in SETTINGS
    }


def parse_value(setting: Setting, raw: Any, origin: str) -> Any:
  """Parses one raw value; `origin` names where it came from for the error message."""
  if isinstance(raw, bool):  # bool is an int: True must not mean a depth of 1.
    raw = {True: MODE_STAGE, False: MODE_OFF}[raw] if setting.field == "mode" else str(raw)
  text = str(raw)
  try:
    return setting.parse(text)
  except ValueError as e:
    raise ConfigError(f"{origin}={text!r} is invalid; {e}") from None


def resolve(
    explicit: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    explicit_source: str = "argument",
) -> StageConfig:
  """Resolves the configuration: explicit values beat env, env beats defaults.

  Args:
    explicit: field name -> value (None means "not given"), e.g. from driver flags.
    env: the environment to read; os.environ when None.
    explicit_source: how explicit values are reported ("argument", "flag").

  An empty env variable counts as unset, as `${VAR:-default}` in the launch recipes does.
  """
  env = os.environ if env is None else env
  explicit = dict(explicit or {})
  unknown = sorted(set(explicit) - set(SETTINGS_BY_FIELD))
  if unknown:
    raise ConfigError(f"unknown staging setting(s) {unknown}; accepted: {sorted(SETTINGS_BY_FIELD)}")
  values: dict[str, Any] = {}
  sources: dict[str, str] = {}
  for s in SETTINGS:
    if explicit.get(s.field) is not None:
      values[s.field] = parse_value(s, explicit[s.field], f"--{s.flag}")
      sources[s.field] = explicit_source
    elif env.get(s.env, "").strip():
      values[s.field] = parse_value(s, env[s.env], s.env)
      sources[s.field] = SOURCE_ENV
    else:
      values[s.field] = s.default
      sources[s.field] = SOURCE_DEFAULT
  return StageConfig(**values, sources=sources)
