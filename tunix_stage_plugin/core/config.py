"""Staging's settings, one table, resolved as explicit > env > default.

Every consumer (the CLI, the flags, `tunix-stage config --check`, the recipes) goes through
`parse_value` and `resolve`: one rule and one range per value. `resolve` names every bad setting
at once in one ConfigError. Every value first meets `value_problem`: no control or invisible
character, no byte that is not UTF-8, no whitespace at either end (refused, never trimmed), so a
value reaches another process as one entry, unchanged. docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import unicodedata
from typing import Any, Callable, Mapping

from tunix_stage_plugin.core import codec_spec
from tunix_stage_plugin.core import inputs

MODE_OFF = "off"
MODE_STAGE = "stage"
MODES = (MODE_OFF, MODE_STAGE)

SOURCE_DEFAULT = "default"
SOURCE_ENV = "env"
SOURCE_INSTALL = "install()"  # settings passed to tunix_stage_plugin.install(...)

ORCHESTRATOR = "orchestrator"
TRAINER = "trainer"
ROLES = (ORCHESTRATOR, TRAINER)


# The largest depth or bound accepted: far above any useful value (each staged batch holds device
# memory), and low enough that a typo such as an extra digit is caught.
MAX_DEPTH = 1024
# Longer raw values are refused before parsing (Python's int() has its own, far larger, limit).
MAX_VALUE_CHARS = 64
# The most steps between two per-step lines (TUNIX_STAGE_LOG_EVERY); 0 says none.
MAX_LOG_EVERY = 1_000_000
# The longest metrics folder accepted (a path: longer than the other settings' values).
MAX_PATH_CHARS = 4096
# Every setting's variable starts with one of these; another name under them is a likely typo.
PREFIXES = ("TUNIX_STAGE_", "TUNIX_MAX_")
# Names under PREFIXES that are not settings and are known not to be typos (another tool's
# variables): the one list of them. None is known today.
OTHER_VARIABLES: tuple[str, ...] = ()


class ConfigError(ValueError):
  """One or more staging settings have values outside what they accept.

  `problems` holds one line per bad setting; str() joins them with "; ".
  """

  def __init__(self, *problems: str) -> None:
    super().__init__("; ".join(problems))
    self.problems = list(problems)


# --- the one rule for every setting's value ---------------------------------------------------

# The characters value_problem names in words; any other it refuses is named by category and code.
CHARACTER_NAMES = {
    "\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\v": "a vertical tab",
    "\f": "a form feed", "\b": "a backspace", "\0": "NUL (0x00)", "\x1b": "ESC (0x1b)",
    "\x7f": "DEL (0x7f)", "\x85": "a next-line character (U+0085)",
    "\u2028": "a line separator (U+2028)", "\u2029": "a paragraph separator (U+2029)",
    "\ufeff": "a byte-order mark (U+FEFF)", " ": "a space",
}
# What no value may hold (Unicode categories): control characters (C0, DEL, C1: a newline or a CR
# would start a second NAME=value line or split a manifest's entry, ESC reach a terminal), format
# characters (invisible: a bidi override shows a value as something else), surrogates (how Python
# reads a byte that is not UTF-8 from the environment or a command line), and the line and
# paragraph separators (a line break to YAML and to Python's str.splitlines).
REFUSED_CATEGORIES = {"Cc": "a control character", "Cf": "an invisible format character",
                      "Cs": "a byte that is not UTF-8", "Zl": "a line separator",
                      "Zp": "a paragraph separator"}


def character_name(char: str) -> str:
  """`char` in the words an error names it with: "a newline", "ESC (0x1b)", "a no-break space
  (U+00A0)", "a byte that is not UTF-8 (0xff)"."""
  if char in CHARACTER_NAMES:
    return CHARACTER_NAMES[char]
  code = ord(char)
  category = unicodedata.category(char)
  if category == "Cs" and 0xDC80 <= code <= 0xDCFF:  # surrogateescape: the byte it stands for
    return f"{REFUSED_CATEGORIES['Cs']} (0x{code - 0xDC00:02x})"
  hex_code = f"0x{code:02x}" if code < 0x80 else f"U+{code:04X}"
  if category in REFUSED_CATEGORIES:
    return f"{REFUSED_CATEGORIES[category]} ({hex_code})"
  if _noncharacter(code):
    return f"a noncharacter ({hex_code})"
  name = unicodedata.name(char, "character").lower()
  return f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({hex_code})"


def _noncharacter(code: int) -> bool:
  """Unicode's noncharacters (U+FDD0..U+FDEF, U+xFFFE, U+xFFFF): not text; YAML readers refuse
  U+FFFE and U+FFFF."""
  return 0xFDD0 <= code <= 0xFDEF or code & 0xFFFE == 0xFFFE


def value_problem(text: str) -> str | None:
  """Why `text` can be no setting's value (None: the setting's own parser judges it): the first
  character no value may hold, by name, or whitespace at either end (never trimmed: `' 2'` is
  refused, not read as 2, as a folder's trailing space would otherwise be silently dropped or
  kept)."""
  for char in text:
    if unicodedata.category(char) in REFUSED_CATEGORIES or _noncharacter(ord(char)):
      return f"it holds {character_name(char)}, which no setting's value may hold"
  for end, char in (("begins", text[:1]), ("ends", text[-1:])):
    if char.isspace():
      return (f"it {end} with {character_name(char)}, and no setting's value may begin or end "
              "with whitespace (none is trimmed)")
  return None


def assignment(name: str, text: str) -> str:
  """`NAME=value` as a note shows a variable it does not read (so never judged): the value as
  given where the rule holds and it is short, else as an error repeats it (inputs.echo), so that
  an ESC or a newline in it never reaches the terminal."""
  if value_problem(text) is None and len(text) <= inputs.MAX_ECHO:
    return f"{name}={text}"
  return f"{name}={inputs.echo(text)}"


# --- each setting's parser (after the rule) ------------------------------------------------------

def _parse_mode(text: str) -> str:
  if text not in MODES:
    raise ValueError(text)
  return text


def _parse_count(text: str) -> int:
  return inputs.integer(text, minimum=1, maximum=MAX_DEPTH)


COUNT_ACCEPTED = inputs.integer_range(1, MAX_DEPTH)

# A depth or bound that sizes itself each step from the job's own measured waits, within the
# memory budget (core.sizing; docs/configuration.md "Staging that sizes itself").
AUTO = "auto"
SIZED_ACCEPTED = f"{AUTO}, or {COUNT_ACCEPTED}"


def _parse_sized(text: str) -> int | str:
  return AUTO if text == AUTO else _parse_count(text)


def is_auto(value: Any) -> bool:
  """Whether a depth or bound's value is `auto` (sized each step)."""
  return value == AUTO


def fixed(field: str, value: Any) -> int:
  """A depth or bound's value, or at auto the fixed value it starts from."""
  return SETTINGS_BY_FIELD[field].fixed if is_auto(value) else value


class Bytes(int):
  """A size in bytes, shown with its unit (8GiB, 512MiB, or bytes where no unit divides it)."""

  def __str__(self) -> str:
    for unit, scale in reversed(UNITS):
      if scale > 1 and self and self % scale == 0:
        return f"{int(self) // scale}{unit}"
    return str(int(self))

  __repr__ = __str__


UNITS = (("", 1), ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30), ("TiB", 1 << 40))
BUDGET_ACCEPTED = "a size in bytes >= 1MiB and <= 1024TiB: a whole number with an optional unit " \
                  "right after it (KiB, MiB, GiB, TiB), e.g. 6GiB, 512MiB, 1073741824"
MIN_BUDGET, MAX_BUDGET = 1 << 20, 1 << 50


def _parse_budget(text: str) -> Bytes:
  match = re.fullmatch(r"([0-9]{1,20})([KMGT]iB)?", text)
  if match is None:
    raise ValueError(text)
  value = int(match[1]) * dict(UNITS)[match[2] or ""]
  if not MIN_BUDGET <= value <= MAX_BUDGET:
    raise ValueError(text)
  return Bytes(value)


def machine_budget() -> Bytes:
  """The memory budget's default: a quarter of this machine's physical memory (1 GiB where the
  machine does not say)."""
  try:
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    total = 4 << 30
  return Bytes(max(MIN_BUDGET, total // 4 // (1 << 20) * (1 << 20)))


def _parse_codec(text: str) -> str:
  if text.strip() == codec_spec.OFF:  # the codec itself (numpy, its library) loads only for one
    return codec_spec.OFF
  # pylint: disable-next=import-outside-toplevel
  from tunix_stage_plugin.core import codec as codec_lib
  spec = codec_lib.parse(text)  # CodecUnavailable: well formed, library missing
  return codec_lib.OFF if spec is None else str(spec)


def _parse_log_every(text: str) -> int:
  return inputs.integer(text, minimum=0, maximum=MAX_LOG_EVERY)


def _parse_metrics(text: str) -> str:
  if text.lower() == "off":
    return ""
  if not text:
    raise ValueError(text)
  return text  # any other text (the rule above holds): the folder, byte for byte


def _parse_fingerprint(text: str) -> str:
  if not re.fullmatch(r"[0-9a-f]{16}", text):
    raise ValueError(text)
  return text


UNSET = "none"  # how help and tables show a setting with no value (a folder or fingerprint unset)


def shown(value: Any) -> str:
  """A setting's value as help and `tunix-stage config` show it (never an empty column)."""
  return UNSET if value == "" else str(value)


@dataclasses.dataclass(frozen=True)
class Setting:
  """One knob: its field name, env variable, driver flag, default and parser."""

  field: str
  env: str
  flag: str
  default: Any
  parse: Callable[[str], Any]  # raises ValueError for a value outside `accepted`
  accepted: str  # what `parse` accepts, as error messages and help say it
  roles: tuple[str, ...]  # the processes that read it (its variable goes to their containers)
  help: str
  metavar: str = "N"  # how --help names its flag's value
  # Launch lines carry its flag even at the default (False: only when set, so a driver that
  # predates the setting keeps its command line).
  flag_at_default: bool = True
  # Its default is this machine's own (derived from it): never passed on to another process's
  # environment at the default (that machine derives its own); said beside the source.
  default_note: str = ""
  max_chars: int = MAX_VALUE_CHARS  # longer raw values are refused before parsing
  # A setting that may be `auto` (sized each step): the fixed value auto starts from, one setting
  # away (the default before auto was), and what a record that lacks the setting ran with.
  fixed: int | None = None


SETTINGS: tuple[Setting, ...] = (
    Setting(
        field="mode",
        env="TUNIX_STAGE_BATCH",
        flag="stage_train_batches",
        default=MODE_OFF,
        parse=_parse_mode,
        accepted=" | ".join(MODES),
        roles=ROLES,
        metavar="|".join(MODES),
        help="off: the host runs exactly as without the plugin; stage: micro-batches are staged "
        "on the trainer's device ahead of their train call.",
    ),
    Setting(
        field="max_staged_batches",
        env="TUNIX_MAX_STAGED_BATCHES",
        flag="max_staged_batches",
        default=AUTO,
        parse=_parse_sized,
        accepted=SIZED_ACCEPTED,
        roles=(ORCHESTRATOR,),
        help="orchestrator: how many micro-batches to keep staged ahead of the pending train call; "
        "auto (the default): chosen each step from the job's measured waits, from 2, within "
        "TUNIX_STAGE_MEMORY_BUDGET.",
        fixed=2,
    ),
    Setting(
        field="max_device_batches",
        env="TUNIX_STAGE_MAX_DEVICE_BATCHES",
        flag="stage_max_device_batches",
        default=1,
        parse=_parse_count,
        accepted=COUNT_ACCEPTED,
        roles=(TRAINER,),
        help="trainer: how many staged batches may sit in device memory (placed or being "
        "placed) at once; a placement over the bound waits for a slot.",
    ),
    Setting(
        field="max_host_batches",
        env="TUNIX_STAGE_MAX_HOST_BATCHES",
        flag="stage_max_host_batches",
        default=AUTO,
        parse=_parse_sized,
        accepted=SIZED_ACCEPTED,
        roles=(TRAINER,),
        help="trainer: how many received micro-batches may wait in host memory for a device slot "
        "(a stage is answered once received; its placement follows on the staging lane); a "
        "stage over the bound is refused and that micro-batch trains inline; auto (the "
        "default): from 1, one more where transfers waited for a buffer, one fewer after quiet "
        "steps, within TUNIX_STAGE_MEMORY_BUDGET.",
        fixed=1,
    ),
    Setting(
        field="codec",
        env="TUNIX_STAGE_CODEC",
        flag="stage_codec",
        default="off",
        parse=_parse_codec,
        accepted=codec_spec.ACCEPTED,
        roles=(ORCHESTRATOR,),
        metavar="CODEC",
        help="orchestrator: compress a staged micro-batch's large arrays (lossless) before they "
        "cross the wire; the trainer decodes them on its staging lane. Inline calls are never "
        "compressed. Needs the codec extra (docs/codec.md).",
        flag_at_default=False,
    ),
    Setting(
        field="accept_train_stage",
        env="TUNIX_STAGE_ACCEPT_TRAIN_STAGE",
        flag="stage_accept_train_stage",
        default="",
        parse=_parse_fingerprint,
        accepted="the 16 hex digits a refusal line printed for tunix's "
        "StandardRLProgram.train_stage",
        roles=ROLES,
        metavar="FINGERPRINT",
        help="stage with a tunix whose StandardRLProgram.train_stage body differs from the one "
        "the staged loop reproduces (refused otherwise): that body's fingerprint, as the "
        "refusal line prints it, once you have checked that the staged loop still does what it "
        "does (docs/tunix.md).",
        flag_at_default=False,
    ),
    Setting(
        field="metrics",
        env="TUNIX_STAGE_METRICS",
        flag="stage_metrics",
        default="",
        parse=_parse_metrics,
        accepted="a folder (made if missing) where each staging process writes its metrics "
        "record, or off",
        roles=ROLES,
        metavar="DIR",
        help="write one JSON-lines record per step of this process's staging figures to "
        "DIR/<role>-<hostname>-<pid>.jsonl (tunix-stage report reads them; "
        "docs/observability.md); a folder that cannot be written is said once and the job "
        "goes on without it.",
        flag_at_default=False,
        max_chars=MAX_PATH_CHARS,
    ),
    Setting(
        field="log_every",
        env="TUNIX_STAGE_LOG_EVERY",
        flag="stage_log_every",
        default=1,
        parse=_parse_log_every,
        accepted=inputs.integer_range(0, MAX_LOG_EVERY),
        roles=ROLES,
        help="print the per-step line (the step's input wait, transfers and what bounded it) "
        "every N steps on stderr; 0: never.",
        flag_at_default=False,
    ),
    Setting(
        field="memory_budget",
        env="TUNIX_STAGE_MEMORY_BUDGET",
        flag="stage_memory_budget",
        default=machine_budget(),
        parse=_parse_budget,
        accepted=BUDGET_ACCEPTED,
        roles=ROLES,
        metavar="SIZE",
        help="the bytes each process's staged micro-batches may hold where a depth or bound is "
        "auto (never exceeded; where one micro-batch alone exceeds it, the least staging that "
        "works, said once).",
        flag_at_default=False,
        default_note="a quarter of this machine's physical memory",
    ),
)
SETTINGS_BY_FIELD = {s.field: s for s in SETTINGS}


def fields_for(role: str) -> tuple[str, ...]:
  """The settings a process of `role` reads, in table order."""
  if role not in ROLES:
    raise ValueError(f"unknown role {role!r}; accepted: {' | '.join(ROLES)}")
  return tuple(s.field for s in SETTINGS if role in s.roles)


@dataclasses.dataclass(frozen=True)
class StageConfig:
  """The effective configuration and, per field, where its value came from."""

  mode: str = MODE_OFF
  max_staged_batches: int | str = AUTO  # or a fixed depth
  max_device_batches: int = 1
  max_host_batches: int | str = AUTO  # or a fixed bound
  codec: str = "off"
  accept_train_stage: str = ""
  metrics: str = ""  # "": no record
  log_every: int = 1
  memory_budget: int = SETTINGS_BY_FIELD["memory_budget"].default
  sources: Mapping[str, str] = dataclasses.field(
      default_factory=lambda: {s.field: SOURCE_DEFAULT for s in SETTINGS}, compare=False
  )

  @property
  def enabled(self) -> bool:
    return self.mode == MODE_STAGE

  def as_dict(self) -> dict[str, dict[str, Any]]:
    return {
        s.field: {"value": getattr(self, s.field), "source": self._source(s), "env": s.env}
        for s in SETTINGS
    }

  def _source(self, setting: Setting) -> str:
    source = self.sources[setting.field]
    if source == SOURCE_DEFAULT and setting.default_note:
      return f"{source}: {setting.default_note}"
    if setting.fixed is not None and is_auto(getattr(self, setting.field)):
      return (f"{source}: sized each step from {setting.fixed}; {setting.env}={setting.fixed} "
              "fixes it")
    return source


def parse_value(setting: Setting, raw: Any, origin: str) -> Any:
  """Parses one raw value; `origin` names where it came from for the error message."""
  if isinstance(raw, bool):  # bool is an int: True must not mean a depth of 1.
    raw = {True: MODE_STAGE, False: MODE_OFF}[raw] if setting.field == "mode" else str(raw)
  text = str(raw)
  problem = value_problem(text)
  if problem is not None:
    raise ConfigError(inputs.invalid(origin, text, setting.accepted, problem))
  if len(text) > setting.max_chars:
    raise ConfigError(inputs.invalid(origin, text, setting.accepted,
                                     f"longer than {setting.max_chars} characters"))
  try:
    return setting.parse(text)
  except codec_spec.CodecUnavailable as e:
    raise ConfigError(inputs.invalid(origin, text, setting.accepted, str(e))) from None
  except ValueError:
    raise ConfigError(inputs.invalid(origin, text, setting.accepted)) from None


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
    explicit_source: how explicit values are reported ("argument", "flag", SOURCE_INSTALL).

  An empty env variable counts as unset, as `${VAR:-default}` in the launch recipes does; any
  other value, whitespace alone included, is judged whole (value_problem).
  """
  env = os.environ if env is None else env
  explicit = dict(explicit or {})
  unknown = sorted(set(explicit) - set(SETTINGS_BY_FIELD))
  if unknown:
    raise ConfigError(f"unknown staging setting(s) {unknown}; accepted: {sorted(SETTINGS_BY_FIELD)}")
  values: dict[str, Any] = {}
  sources: dict[str, str] = {}
  problems: list[str] = []
  for s in SETTINGS:
    try:
      if explicit.get(s.field) is not None:
        name = f"install({s.field})" if explicit_source == SOURCE_INSTALL else f"--{s.flag}"
        values[s.field] = parse_value(s, explicit[s.field], name)
        sources[s.field] = explicit_source
      elif env.get(s.env, ""):
        values[s.field] = parse_value(s, env[s.env], s.env)
        sources[s.field] = SOURCE_ENV
      else:
        values[s.field] = s.default
        sources[s.field] = SOURCE_DEFAULT
    except ConfigError as e:
      problems += e.problems  # go on: every bad setting is reported at once
  if problems:
    raise ConfigError(*problems)
  return StageConfig(**values, sources=sources)


def unknown_variables(env: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
  """(name, the closest setting's variable) for each variable in `env` (os.environ when None)
  under PREFIXES that is neither a setting's nor in OTHER_VARIABLES: nothing reads it."""
  env = os.environ if env is None else env
  known = {s.env for s in SETTINGS} | set(OTHER_VARIABLES)
  unknown = sorted(n for n in env if n.startswith(PREFIXES) and n not in known)
  if not unknown:
    return []
  import difflib  # pylint: disable=import-outside-toplevel  (only when there is one)
  # Compared without the prefixes, which a guess mixes up (TUNIX_MAX_STAGED_BATCHES breaks its
  # siblings' TUNIX_STAGE_* pattern, so TUNIX_STAGE_MAX_STAGED_BATCHES is a likely guess).
  stem = lambda name: name.removeprefix("TUNIX_").removeprefix("STAGE_")
  by_stem = {stem(s.env): s.env for s in SETTINGS}
  return [(n, by_stem[difflib.get_close_matches(stem(n), by_stem, n=1, cutoff=0.0)[0]])
          for n in unknown]


def unknown_variable_line(name: str, closest: str) -> str:
  """The warning's text for one unknown variable; never an error, since another tool may own
  such a name."""
  return (f"{name} is not a staging variable, so nothing reads it; did you mean {closest}? "
          "(the settings: docs/configuration.md)")


def unknown_variable_lines(env: Mapping[str, str] | None = None) -> list[str]:
  """One warning text per unknown variable in `env` (os.environ when None)."""
  return [unknown_variable_line(name, closest) for name, closest in unknown_variables(env)]


class LiveConfig:
  """The configuration an installation's hooks read at run time. Activation hands it down to the
  hooks; a re-install with new depths `update`s it, and listeners apply them to live objects."""

  def __init__(self, config: StageConfig) -> None:
    self._lock = threading.Lock()
    self._config = config
    self._listeners: list[Callable[[StageConfig], None]] = []

  @property
  def config(self) -> StageConfig:
    return self._config

  def on_update(self, listener: Callable[[StageConfig], None]) -> None:
    with self._lock:
      self._listeners.append(listener)

  def update(self, config: StageConfig) -> None:
    with self._lock:
      self._config = config
      listeners = list(self._listeners)
    for listener in listeners:
      listener(config)
