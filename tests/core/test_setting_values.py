"""Every setting of the table x hostile values x every consumer: one rule (issue 50).

A value is refused with its setting's one line (exit 2 where a command judges it), or carried as
exactly one entry, unchanged: never a second entry made from one value (a newline in
TUNIX_STAGE_METRICS once gave a manifest an env entry of its own).

The hostile pieces: a newline, a CR, a tab, ESC, NEL, a line separator, DEL, a byte that is not
UTF-8, a bidi override; a quote of each kind, `: `, `#`, `${X}`, `$(x)`, a backslash, a space; a
leading `-`; 4 KiB of text. Each is put alone, before, inside or after a valid value of each
setting. What each setting must do with it is said here, apart from the code (`expected`): a
control, invisible or non-UTF-8 character is refused by name, whitespace at either end is
refused, a value longer than the setting's limit is refused; past that, only the metrics folder
(a path) takes the printable pieces, and it keeps them byte for byte.

The consumers in this process, each given every setting at once (so one call judges nine):
`config.resolve` from the environment and from `install(...)`, a driver's own argparse parser
with `add_argparse_flags` (both flag spellings), a known driver's parse function
(`drivers.accepting_flags`), `tunix-stage config --check` (env and flags), `--env_for ROLE`,
`--flags_for ROLE`, `tunix-stage run --dry_run` and `tunix-stage bench`'s settings. The recipes
run in subprocesses for two cases (every setting refused at once; every setting accepted, the
folder a 4 KiB path holding every printable piece): `mlperf_base.sh`, `k8s_launcher.sh --dry_run`
and `local_launcher.sh` through a stand-in for tunix's runtime that records what each process
got. About 10 s on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import shlex
import tempfile
import textwrap
from typing import Any
from unittest import mock

from hypothesis import given, settings, strategies as st
import pytest
import yaml

from tests.recipes.test_local import launch  # noqa: F401  pylint: disable=unused-import
from tests.recipes.test_recipes import BASE, IMAGE, K8S, LOCAL, base_env, run
from tunix_stage_plugin.activation import drivers
from tunix_stage_plugin.cli import main as cli_main
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import flags as flags_lib
from tunix_stage_plugin.core import inputs
from tunix_stage_plugin.hosts import triggers

SETTINGS = config_lib.SETTINGS
ROLES = config_lib.ROLES
# A valid value of each setting, not its default (so that every consumer carries it).
BASE_VALUES = {"mode": "stage", "max_staged_batches": "3", "max_device_batches": "2",
               "max_host_batches": "2", "codec": "off", "accept_train_stage": "0123456789abcdef",
               "metrics": "/tmp/m", "log_every": "5", "memory_budget": "5000MiB"}
# The pieces no value may hold, and how a refusal names each.
REFUSED = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x1b": "ESC (0x1b)",
           "\x85": "a next-line character (U+0085)", "\u2028": "a line separator (U+2028)",
           "\x7f": "DEL (0x7f)", "\udcff": "a byte that is not UTF-8 (0xff)",
           "\u202e": "an invisible format character (U+202E)"}
PRINTABLE = ("'", '"', "`", ": ", "#", "${X}", "$(x)", "\\", " ")
PLACEMENTS = ("alone", "before", "inside", "after")
KIB4 = 4096
RULE_WHITESPACE = "no setting's value may begin or end with whitespace (none is trimmed)"
# A 4 KiB folder holding every printable piece and a leading '-': what the recipes must carry.
HOSTILE_PATH = "-/tmp/a: b #c ${X} $(x) \"d\" 'e' `f` \\g é ~h;i|j&k*l?m[n]<o>!p"
HOSTILE_PATH += "/" + "d" * (KIB4 - len(HOSTILE_PATH) - 1)


def test_every_setting_has_a_valid_value_here():
  assert set(BASE_VALUES) == {s.field for s in SETTINGS}  # a new setting: add its value
  assert len(HOSTILE_PATH) == KIB4
  for s in SETTINGS:
    config_lib.parse_value(s, BASE_VALUES[s.field], s.env)


def placed(field: str, piece: str, where: str) -> str:
  base = BASE_VALUES[field]
  return {"alone": piece, "before": piece + base, "inside": base[:1] + piece + base[1:],
          "after": base + piece}[where]


def hostile(field: str, kind: str, where: str) -> str:
  """One hostile value for `field`: a piece of REFUSED or PRINTABLE placed, a leading '-', or
  4 KiB (a 4 KiB folder is within the path's limit; one character more is not)."""
  base = BASE_VALUES[field]
  if kind == "dash":
    return "-" + base
  if kind == "4KiB":
    return (base + "x" * KIB4)[:KIB4 + (where == "after")]
  return placed(field, kind, where)


KINDS = (*REFUSED, *PRINTABLE, "dash", "4KiB")
# Each kind where it differs: a dash only leads; 4 KiB exactly (alone) and one character more.
CASES = [(kind, where) for kind in (*REFUSED, *PRINTABLE) for where in PLACEMENTS] + [
    ("dash", "before"), ("4KiB", "alone"), ("4KiB", "after")]


def expected(setting: config_lib.Setting, value: str) -> tuple[str, Any]:
  """("refused", the one line) or ("carried", what every consumer carries), said apart from the
  code under test: only the formatting of the line is the project's (inputs.invalid)."""
  def refused(why: str | None = None) -> tuple[str, Any]:
    return "refused", inputs.invalid(setting.env, value, setting.accepted, why)

  for char in value:
    if char in REFUSED:
      return refused(f"it holds {REFUSED[char]}, which no setting's value may hold")
  if value[:1] == " ":
    return refused(f"it begins with a space, and {RULE_WHITESPACE}")
  if value[-1:] == " ":
    return refused(f"it ends with a space, and {RULE_WHITESPACE}")
  limit = config_lib.MAX_PATH_CHARS if setting.field == "metrics" else config_lib.MAX_VALUE_CHARS
  if len(value) > limit:
    return refused(f"longer than {limit} characters")
  if setting.field == "metrics":
    return "carried", "" if value == "off" else value  # a folder: any other text, as it is
  if value == BASE_VALUES[setting.field]:
    return "carried", value
  return refused()  # every printable piece and a leading '-' are outside the other grammars


def with_origin(line: str, setting: config_lib.Setting, origin: str) -> str:
  """The line as a consumer that names the value by `origin` (a flag, install(...)) says it."""
  return origin + line.removeprefix(setting.env)


# --- running the consumers in this process -------------------------------------------------------


def cli(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
  """`tunix-stage ARGV` in this process with exactly `env`'s staging variables."""
  # pylint: disable-next=import-outside-toplevel
  from tunix_stage_plugin.lab.bench import runner

  class Started(BaseException):
    pass

  def run_bench(options, *_args, **_kwargs):
    out.write("BENCH " + json.dumps({"max_device_batches": options.max_device_batches,
                                     "max_host_batches": options.max_host_batches,
                                     "codec": options.codec}))
    raise Started

  clean = {k: v for k, v in os.environ.items() if not k.startswith(config_lib.PREFIXES)}
  out, err = io.StringIO(), io.StringIO()
  with mock.patch.dict(os.environ, {**clean, **env}, clear=True), \
      mock.patch.object(runner, "run_bench", run_bench), \
      contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = cli_main.main(list(argv))
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else 1
    except Started:
      code = 0
  return code, out.getvalue(), err.getvalue()


def flag_argv(values: dict[str, str], fields, joined: bool) -> list[str]:
  """The flags of `fields` with `values`, as `--flag=VALUE` or `--flag VALUE`. (A bare
  --stage_train_batches means stage, so its value goes after '=' where it begins with '-'.)"""
  argv = []
  for field in fields:
    s, value = config_lib.SETTINGS_BY_FIELD[field], values[field]
    if joined or (field == "mode" and value.startswith("-")):
      argv.append(f"--{s.flag}={value}")
    else:
      argv += [f"--{s.flag}", value]
  return argv


def check_lines(found: list[str], values: dict[str, str], fields, origin=None, prefix=""):
  """`found` holds exactly the refused settings' lines, in table order."""
  want = []
  for field in fields:
    s = config_lib.SETTINGS_BY_FIELD[field]
    kind, line = expected(s, values[field])
    if kind == "refused":
      want.append(prefix + (with_origin(line, s, origin(s)) if origin else line))
  assert found == want


def carried(field: str, values: dict[str, str]) -> str:
  """What every consumer carries for an accepted value of `field` (as text)."""
  kind, value = expected(config_lib.SETTINGS_BY_FIELD[field], values[field])
  assert kind == "carried"
  return value


def check_config(cfg: config_lib.StageConfig, values: dict[str, str], fields) -> None:
  assert {f: str(getattr(cfg, f)) for f in fields} == {f: carried(f, values) for f in fields}


def problems_of(judge, values: dict[str, str], fields) -> list[str]:
  """judge()'s ConfigError lines; none where it returns a configuration, which must carry each
  of `fields` as expected."""
  try:
    cfg = judge()
  except config_lib.ConfigError as e:
    return e.problems
  check_config(cfg, values, fields)
  return []


def assignments(lines: list[str]) -> dict[str, str]:
  """NAME=value lines as a dict, each name once."""
  found = {}
  for line in lines:
    name, sep, value = line.partition("=")
    assert sep and name not in found, line
    found[name] = value
  return found


def consumers(values: dict[str, str]) -> None:
  """Every in-process consumer, given every setting's value of `values` at once."""
  with tempfile.TemporaryDirectory() as folder:
    _consumers(values, pathlib.Path(folder))


def _consumers(values: dict[str, str], folder: pathlib.Path) -> None:
  fields = [s.field for s in SETTINGS]
  env = {s.env: values[s.field] for s in SETTINGS}
  outcomes = {s.field: expected(s, values[s.field]) for s in SETTINGS}
  refused = [f for f in fields if outcomes[f][0] == "refused"]
  # The environment and install(...).
  check_lines(problems_of(lambda: config_lib.resolve(env=env), values, fields), values, fields)
  check_lines(problems_of(lambda: config_lib.resolve(
      values, env={}, explicit_source=config_lib.SOURCE_INSTALL), values, fields),
              values, fields, origin=lambda s: f"install({s.field})")
  # A driver's own parser, both spellings; a known driver's parse function (orchestrator's).
  for joined in (True, False):
    parser = flags_lib.add_argparse_flags(argparse.ArgumentParser(prog="driver"))
    args = parser.parse_args(flag_argv(values, fields, joined))
    check_lines(problems_of(lambda: flags_lib.config_from_argparse(args), values, fields),
                values, fields, origin=lambda s: f"--{s.flag}")
  driver = triggers.find("tunix_stage_plugin.lab.embedded.orchestrator_main")
  orchestrator = config_lib.fields_for(config_lib.ORCHESTRATOR)
  err = io.StringIO()
  configured = []
  parse = drivers.accepting_flags(lambda argv: argparse.Namespace(rest=argv), driver,
                                  lambda config, host: configured.append(config))
  with contextlib.redirect_stderr(err), mock.patch.dict(os.environ, {}, clear=True):
    try:
      namespace = parse([*flag_argv(values, orchestrator, False), "--driver_flag", "x"])
      assert namespace.rest == ["--driver_flag", "x"]  # the driver's own, untouched
    except SystemExit as e:
      assert e.code == 2
  check_lines(err.getvalue().splitlines(), values, orchestrator,
              origin=lambda s: f"--{s.flag}", prefix=f"{driver.module}: error: ")
  if configured:  # accepted: what the driver's process is configured with
    check_config(configured[0], values, orchestrator)
  # tunix-stage config: --check from env and from flags; --env_for / --flags_for carry.
  for argv, cli_env, origin in ((["config", "--check"], env, None),
                                (["config", "--check", *flag_argv(values, fields, False)], {},
                                 lambda s: f"--{s.flag}"),
                                (["config", "--env_for", "trainer"], env, None)):
    code, out, err_text = cli(argv, cli_env)
    assert (code, out) == ((2, "") if refused else (0, out)), (argv, err_text)
    check_lines(err_text.splitlines(), values, fields, origin=origin,
                prefix="tunix-stage config: error: ")
  # The accepted ones alone (any refused one stops --env_for and --flags_for, as checked above).
  accepted = [f for f in fields if f not in refused]
  accepted_env = {config_lib.SETTINGS_BY_FIELD[f].env: values[f] for f in accepted}
  for role in ROLES:
    code, out, err_text = cli(["config", "--env_for", role], accepted_env)
    assert code == 0 and err_text == ""
    assert out.endswith("\n") and out.splitlines() == out.split("\n")[:-1]  # no other break
    found = assignments(out.splitlines())
    # One entry per setting the role reads, in table order (the budget only where set).
    reads = [f for f in config_lib.fields_for(role) if f != "memory_budget" or f in accepted]
    assert list(found) == [config_lib.SETTINGS_BY_FIELD[f].env for f in reads]
    for field in set(reads) & set(accepted):
      assert found[config_lib.SETTINGS_BY_FIELD[field].env] == carried(field, values)
  code, out, err_text = cli(["config", "--flags_for", "orchestrator"],
                            {**accepted_env, "TUNIX_STAGE_BATCH": "stage"})
  assert code == 0 and err_text == ""
  want = {"--stage_train_batches": "stage"}
  for field in orchestrator:
    s = config_lib.SETTINGS_BY_FIELD[field]
    if field in accepted and field != "mode" and (s.flag_at_default or
                                                  carried(field, values) != str(s.default)):
      want[f"--{s.flag}"] = carried(field, values)
    elif s.flag_at_default and field != "mode":
      want[f"--{s.flag}"] = str(s.default)
  assert assignments(out.splitlines()) == want
  # tunix-stage run --dry_run: the child's environment as shell words, one per variable.
  code, out, err_text = cli(["run", "--dry_run", *flag_argv(values, fields, False), "--",
                             "job"], {})
  if refused:
    assert code == 2
    check_lines(err_text.splitlines(), values, fields, origin=lambda s: f"--{s.flag}",
                prefix="tunix-stage run: error: ")
  else:
    words = shlex.split(out)
    assert words[-1] == "job"
    assert assignments(words[:-1]) == {s.env: carried(s.field, values) for s in SETTINGS}
  # tunix-stage bench: its three flags, and the variables it reads.
  bench_flags = ("max_device_batches", "max_host_batches", "codec")
  bench_env = {config_lib.SETTINGS_BY_FIELD[f].env: values[f]
               for f in ("log_every", "memory_budget")}
  code, out, err_text = cli(["bench", "--out", str(folder / "out"),
                             *flag_argv(values, bench_flags, False)], bench_env)
  judged = [*bench_flags, "log_every", "memory_budget"]
  bench_lines = [line for line in err_text.splitlines()
                 if any(f"{config_lib.SETTINGS_BY_FIELD[f].env}=" in line
                        or f"--{config_lib.SETTINGS_BY_FIELD[f].flag}=" in line for f in judged)]
  check_lines(bench_lines, values, judged, origin=lambda s: (
      f"--{s.flag}" if s.field in bench_flags else s.env), prefix="tunix-stage bench: error: ")
  if not any(f in refused for f in judged):
    assert code == 0, err_text
    ran = json.loads(out.partition("BENCH ")[2])
    assert [str(ran[f]) for f in bench_flags] == [carried(f, values) for f in bench_flags]


@pytest.mark.parametrize("kind, where", CASES,
                         ids=[f"{ascii(k).strip(chr(39))}-{w}" for k, w in CASES])
def test_one_hostile_piece_in_every_setting_at_once(kind: str, where: str):
  consumers({s.field: hostile(s.field, kind, where) for s in SETTINGS})


@st.composite
def mixed(draw) -> dict[str, str]:
  """Each setting its own hostile value, or its valid one (so that some are carried)."""
  values = {}
  for s in SETTINGS:
    if draw(st.integers(0, 3)) == 0:
      values[s.field] = BASE_VALUES[s.field]
    else:
      values[s.field] = hostile(s.field, draw(st.sampled_from(KINDS)),
                                draw(st.sampled_from(PLACEMENTS)))
  return values


@settings(derandomize=True, database=None, deadline=None, max_examples=60)
@given(values=mixed())
def test_hostile_values_mixed_across_the_settings(values):
  consumers(values)


def test_the_folder_takes_every_printable_piece_as_it_is():
  """The one setting that takes them: what the consumers above carry for it, and the limit."""
  metrics = config_lib.SETTINGS_BY_FIELD["metrics"]
  assert config_lib.parse_value(metrics, HOSTILE_PATH, metrics.env) == HOSTILE_PATH
  consumers({**BASE_VALUES, "metrics": HOSTILE_PATH})
  consumers({**BASE_VALUES, "metrics": HOSTILE_PATH + "d"})  # 4097 characters: refused


# --- the recipes (subprocesses: two cases each) ---------------------------------------------------

# Every setting refused at once: each a different piece no value may hold, inside a valid value.
ALL_REFUSED = {s.field: placed(s.field, piece, "inside") for s, piece in zip(SETTINGS, REFUSED)}
# Every setting accepted, none at its default, the folder holding every printable piece.
ALL_ACCEPTED = {**BASE_VALUES, "metrics": HOSTILE_PATH}


def recipe_env(values: dict[str, str]) -> dict[str, str]:
  return {config_lib.SETTINGS_BY_FIELD[f].env: v for f, v in values.items()}


def refusal_lines(values: dict[str, str]) -> list[str]:
  return [f"mlperf_base.sh: error: invalid staging setting: {expected(s, values[s.field])[1]}"
          for s in SETTINGS]


def role_env(role: str) -> dict[str, str]:
  """What a process of `role` must get: one entry per setting it reads, as the plugin carries."""
  return {config_lib.SETTINGS_BY_FIELD[f].env: expected(config_lib.SETTINGS_BY_FIELD[f],
                                                        ALL_ACCEPTED[f])[1]
          for f in config_lib.fields_for(role)}


def orchestrator_flags() -> list[str]:
  return [f"--{config_lib.SETTINGS_BY_FIELD[f].flag}={ALL_ACCEPTED[f]}"
          for f in config_lib.fields_for(config_lib.ORCHESTRATOR) if f != "codec"]


def test_all_accepted_is_what_it_says_and_all_refused_refuses_each():
  assert len(ALL_REFUSED) == len(SETTINGS)  # one piece per setting
  assert all(expected(s, ALL_REFUSED[s.field])[0] == "refused" for s in SETTINGS)
  assert all(expected(s, ALL_ACCEPTED[s.field])[0] == "carried" for s in SETTINGS)


@pytest.mark.parametrize("script, args", [
    (BASE, ()), (K8S, ("--command", "start", "--image", IMAGE, "--dry_run")),
    (LOCAL, ("--host", "embedded"))], ids=lambda a: getattr(a, "name", None))
def test_each_recipe_refuses_every_bad_setting_with_its_line(tmp_path: pathlib.Path, script,
                                                             args):
  proc = run(script, *args, env=base_env(tmp_path, **recipe_env(ALL_REFUSED)))
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.splitlines() == refusal_lines(ALL_REFUSED)


def test_mlperf_base_shows_one_word_per_flag(tmp_path: pathlib.Path):
  proc = run(BASE, env=base_env(tmp_path, **recipe_env(ALL_ACCEPTED),
                                ORCHESTRATOR_MAIN="tunix_stage_plugin.lab.embedded."
                                "orchestrator_main.main"))
  assert proc.returncode == 0, proc.stderr
  (line,) = [l for l in proc.stdout.splitlines() if l.startswith("orchestrator: env [")]
  names, _, flags = line.removeprefix("orchestrator: env [").partition("] flags [")
  assert names.split() == list(role_env("orchestrator"))
  assert shlex.split(flags.removesuffix("]")) == orchestrator_flags()


def test_k8s_dry_run_carries_each_setting_as_one_entry(tmp_path: pathlib.Path):
  proc = run(K8S, "--command", "start", "--image", IMAGE, "--dry_run",
             env=base_env(tmp_path, **recipe_env(ALL_ACCEPTED),
                          ORCHESTRATOR_MAIN="tunix_stage_plugin.lab.embedded.orchestrator_main"))
  assert proc.returncode == 0, proc.stderr
  docs = [d for d in yaml.safe_load_all(proc.stdout) if d is not None]
  for doc in docs:
    role = doc["metadata"]["labels"]["app.kubernetes.io/component"]
    (job,) = doc["spec"]["replicatedJobs"]
    (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
    entries = container.get("env") or []
    assert [e["name"] for e in entries] == list(role_env(role) if role in ROLES else {})
    assert {e["name"]: e["value"] for e in entries} == (role_env(role) if role in ROLES else {})
    staging = [a for a in container["command"] if a.startswith(tuple(
        f"--{s.flag}" for s in SETTINGS))]
    assert staging == (orchestrator_flags() if role == "orchestrator" else [])


FAKE_RUNTIME = textwrap.dedent('''\
    """A stand-in for tunix's runtime main: records its argv and staging variables; the
    orchestrator then waits for the others' records, the others until they are stopped."""
    import json, os, pathlib, signal, sys, time
    if __name__ == "__main__":
      out = pathlib.Path(os.environ["FAKE_RUNTIME_OUT"])
      args = sys.argv[1:]
      role = ("orchestrator" if any(a.startswith("--discovery_id=") for a in args) else
              "rollout" if any(a.startswith("--worker_index=") for a in args) else "trainer")
      env = {k: v for k, v in os.environ.items() if k.startswith(("TUNIX_STAGE_", "TUNIX_MAX_"))}
      (out / f"{role}.tmp").write_text(json.dumps({"argv": args, "env": env}))
      (out / f"{role}.tmp").rename(out / f"{role}.json")
      if role != "orchestrator":
        signal.pause()
      deadline = time.monotonic() + 30
      while not all((out / f"{r}.json").exists() for r in ("trainer", "rollout")):
        if time.monotonic() > deadline:
          sys.exit("the trainer's and the rollout's records never came")
        time.sleep(0.02)
''')


def test_local_launcher_gives_each_process_each_setting_as_one_entry(
    tmp_path: pathlib.Path, launch):  # pylint: disable=redefined-outer-name
  # tunix's runtime main as the launcher probes and runs it, first on PYTHONPATH.
  runtime = tmp_path / "fake" / "tunix" / "experimental" / "distributed" / "runtime"
  runtime.mkdir(parents=True)
  for folder in (runtime, *list(runtime.parents)[:3]):
    (folder / "__init__.py").write_text("")
  (runtime / "main.py").write_text(FAKE_RUNTIME)
  (runtime / "executor.py").write_text("")
  out = tmp_path / "records"
  out.mkdir()
  proc = launch("--host", "tunix", "--timeout", "60", "--log_dir", str(tmp_path / "logs"),
                **recipe_env(ALL_ACCEPTED), PYTHONPATH=str(tmp_path / "fake"),
                FAKE_RUNTIME_OUT=str(out),
                ORCHESTRATOR_MAIN="tunix_stage_plugin.lab.embedded.orchestrator_main.main",
                TRAINER_MAIN="json.loads", ROLLOUT_MAIN="json.dumps")
  assert proc.returncode == 0, proc.stdout + proc.stderr
  for role in (*ROLES, "rollout"):
    want = role_env(role) if role in ROLES else {}
    (line,) = [l for l in proc.stdout.splitlines() if f" started {role} pid=" in l]
    shown = line.partition(" env:")[2]
    if want:  # what the launcher says: one shell word per variable
      assert assignments(shlex.split(shown)) == want
    else:
      assert shown == " (no staging variables)"
    record = json.loads((out / f"{role}.json").read_text())
    assert record["env"] == want  # what the process got
    staging = [a for a in record["argv"] if a.startswith(tuple(f"--{s.flag}" for s in SETTINGS))]
    assert staging == (orchestrator_flags() if role == "orchestrator" else [])
