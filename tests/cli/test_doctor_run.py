"""`tunix-stage doctor` and `tunix-stage run`.

The doctor's host is a fake adapter defined here (absent, or present with probes that pass or
fail): it stands in for tunix because tunix's experimental stack cannot be installed in CI.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import signal
import subprocess
import sys

import pytest

from tunix_stage_plugin.activation import entry_points
from tunix_stage_plugin.cli import main as cli_main
from tunix_stage_plugin.cli import run_cmd
from tunix_stage_plugin.core import codec as codec_lib
from tunix_stage_plugin.hosts.probing import Probe

ENV_NAMES = ("TUNIX_STAGE_BATCH", "TUNIX_MAX_STAGED_BATCHES", "TUNIX_STAGE_MAX_DEVICE_BATCHES")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
  for name in ENV_NAMES:
    monkeypatch.delenv(name, raising=False)


class Adapter:
  name = "tunix"
  trigger_modules = ("tunix.experimental.worker.remote_execution",)
  hook_groups = ("server: a", "worker: b")

  def __init__(self, importable=True, probes_ok=True):
    self.importable = importable
    self.probes_ok = probes_ok

  def load(self):
    if not self.importable:
      raise ModuleNotFoundError("No module named 'tunix'")

  def describe(self):
    return "tunix 0.1.8 (commit c7d8950)"

  def describe_loop(self):  # the tunix adapter's: which way the train loop is staged
    return "the plugin's copy of tunix c7d8950's train_stage (fingerprint-pinned)"

  def probe(self, config):
    return [Probe("worker: TrainerWorker.fwd_bwd", self.probes_ok, "fwd_bwd takes no **kwargs"),
            Probe("trainer: PeftTrainer._prepare_payload", True)]


@pytest.fixture
def host(monkeypatch):
  adapter = Adapter()
  monkeypatch.setattr(entry_points, "load_adapter", lambda name: adapter)
  return adapter


def doctor(capsys, *args):
  code = cli_main.main(["doctor", *args])
  return code, capsys.readouterr()


def test_doctor_tunix_absent_staging_off_exits_0(host, capsys):
  host.importable = False
  code, out = doctor(capsys)
  assert code == 0
  assert "staging: off" in out.out and "host: tunix not importable" in out.out
  assert "note: tunix is not importable: ModuleNotFoundError: No module named 'tunix'" in out.out


def test_doctor_tunix_absent_staging_requested_exits_1(host, capsys, monkeypatch):
  host.importable = False
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  code, out = doctor(capsys)
  assert code == 1
  assert "error: tunix is not importable" in out.out and "staging can work" not in out.out


def test_doctor_flag_requests_staging_too(host, capsys):
  host.importable = False
  code, _ = doctor(capsys, "--stage_train_batches")
  assert code == 1


def test_doctor_failed_probe_exits_1_and_names_it(host, capsys, monkeypatch):
  host.probes_ok = False
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  code, out = doctor(capsys)
  assert code == 1
  assert "[FAIL] worker: TrainerWorker.fwd_bwd: fwd_bwd takes no **kwargs" in out.out
  assert "[ok] trainer: PeftTrainer._prepare_payload" in out.out


def test_doctor_all_good_exits_0_and_lists_what_it_would_install(host, capsys, monkeypatch):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  monkeypatch.setenv("TUNIX_MAX_STAGED_BATCHES", "3")
  code, out = doctor(capsys)
  assert code == 0, out.out
  assert "host: tunix 0.1.8 (commit c7d8950)" in out.out
  assert "TUNIX_MAX_STAGED_BATCHES         3        (env)" in out.out
  assert "hooks installed in this process: none" in out.out
  assert "hooks staging installs: server: a; worker: b" in out.out
  assert out.out.rstrip().endswith("staging can work here")


def test_doctor_invalid_setting_exits_2(host, capsys, monkeypatch):
  monkeypatch.setenv("TUNIX_MAX_STAGED_BATCHES", "-1")
  code, out = doctor(capsys)
  assert code == 2
  assert "TUNIX_MAX_STAGED_BATCHES='-1' is invalid" in out.err


def test_doctor_json(host, capsys, monkeypatch):
  host.importable = False
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "stage")
  code, out = doctor(capsys, "--json", "--max_staged_batches", "4")
  report = json.loads(out.out)
  assert code == report["exit"] == 1
  assert report["host"] is None and report["config"]["enabled"] is True
  assert report["config"]["settings"]["max_staged_batches"] == {
      "value": 4, "source": "flag", "env": "TUNIX_MAX_STAGED_BATCHES"}
  assert report["entry_points"] == ["maxtext", "tunix"]
  assert any("tunix is not importable" in p and "google/tunix main" in p
             for p in report["problems"])


def dry_run(capsys, *args):
  code = cli_main.main(["run", "--dry_run", *args])
  return code, capsys.readouterr()


def test_run_switches_staging_on_by_default(capsys):
  code, out = dry_run(capsys, "--", "python", "-m", "pkg.main", "--flag=a b")
  assert code == 0
  assert out.out.strip() == "TUNIX_STAGE_BATCH=stage python -m pkg.main '--flag=a b'"


def test_run_forwards_flags_and_flags_beat_env(capsys, monkeypatch):
  monkeypatch.setenv("TUNIX_MAX_STAGED_BATCHES", "2")
  code, out = dry_run(capsys, "--max_staged_batches", "3", "--stage_max_device_batches", "2",
                      "--", "cmd")
  assert code == 0
  assert out.out.strip() == ("TUNIX_MAX_STAGED_BATCHES=3 TUNIX_STAGE_BATCH=stage "
                             "TUNIX_STAGE_MAX_DEVICE_BATCHES=2 cmd")


def test_run_respects_a_mode_already_given(capsys, monkeypatch):
  monkeypatch.setenv("TUNIX_STAGE_BATCH", "off")
  assert dry_run(capsys, "--", "cmd")[1].out.strip() == "cmd"  # env says off: left off
  assert dry_run(capsys, "--stage_train_batches", "stage", "--", "cmd")[1].out.strip() == (
      "TUNIX_STAGE_BATCH=stage cmd")


def test_run_errors(capsys):
  assert cli_main.main(["run"]) == 2
  assert capsys.readouterr().err == ("tunix-stage run: error: COMMAND is invalid: none given; "
                                     "accepted: tunix-stage run [flags] -- COMMAND [ARGS ...]\n")
  assert cli_main.main(["run", "--max_staged_batches", "0", "--", "cmd"]) == 2
  assert "--max_staged_batches='0' is invalid" in capsys.readouterr().err


def test_run_execs_with_the_environment(monkeypatch):
  seen = {}

  def fake_exec(file, argv, env):
    seen.update(file=file, argv=argv, env=env)

  monkeypatch.setattr(os, "execvpe", fake_exec)
  assert cli_main.main(["run", "--", "trainer", "--x"]) == 0
  assert seen["file"] == "trainer" and seen["argv"] == ["trainer", "--x"]
  assert seen["env"]["TUNIX_STAGE_BATCH"] == "stage"


def test_run_reports_a_missing_command(capsys):
  assert cli_main.main(["run", "--", "/nonexistent/tunix-stage-cmd"]) == 127
  assert "cannot run '/nonexistent/tunix-stage-cmd'" in capsys.readouterr().err


def test_run_exits_126_for_a_command_that_exists_but_cannot_be_executed(tmp_path, capsys):
  script = tmp_path / "not-executable.sh"
  script.write_text("#!/bin/sh\necho never\n")
  script.chmod(0o644)
  assert cli_main.main(["run", "--", str(script)]) == 126  # the shell's status for it
  assert f"cannot run '{script}': Permission denied" in capsys.readouterr().err


def test_the_command_run_gets_sigpipe_back_as_a_shell_would_start_it():
  # Python ignores SIGPIPE, and exec keeps an ignored signal ignored: without the reset, a
  # command run through `tunix-stage run` would never die of a closed pipe (`yes | head -1`).
  proc = subprocess.run([sys.executable, "-m", "tunix_stage_plugin.cli.main", "run", "--",
                         "cat", "/proc/self/status"], capture_output=True, text=True, timeout=60,
                        check=True)
  ignored = int(next(l for l in proc.stdout.splitlines() if l.startswith("SigIgn:")).split()[1],
                16)
  assert not ignored & (1 << (signal.SIGPIPE - 1)), hex(ignored)


def test_run_child_activates_the_bootstrap():
  # End to end: the wrapper execs a Python child, whose start-up .pth imports the bootstrap.
  env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
  code = ("import os, sys; print(os.environ['TUNIX_STAGE_BATCH'], "
          "'tunix_stage_plugin.activation.bootstrap' in sys.modules)")
  out = subprocess.run([sys.executable, "-m", "tunix_stage_plugin.cli.main", "run", "--",
                        sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, check=True)
  assert out.stdout.split() == ["stage", "True"]


def test_child_environment_only_lists_changes():
  args = cli_main.build_parser().parse_args(["run", "--", "cmd"])
  assert run_cmd.child_environment(args, {"TUNIX_STAGE_BATCH": "stage"}) == {}


@pytest.mark.parametrize("installed", [False, True])
def test_doctor_names_the_codecs_this_process_can_use(host, capsys, monkeypatch, installed):
  monkeypatch.setattr(codec_lib, "installed", lambda name: installed)
  code, out = doctor(capsys)
  assert code == 0
  line = next(l for l in out.out.splitlines() if l.startswith("codecs (TUNIX_STAGE_CODEC"))
  if installed:
    assert line.endswith(": blosc2-zstd, blosc2-lz4")
  else:
    # The hint fits this installation: the suite runs from a checkout, installed editable.
    assert line.endswith(f": none installed ({codec_lib.EXTRA}: pip install -e "
                         f"'{Path(__file__).resolve().parents[2]}[codec]')"), line


class MaxTextAdapter(Adapter):
  name = "maxtext"

  def load(self):
    if not self.importable:
      raise ModuleNotFoundError("No module named 'maxtext'")

  def describe(self):
    return "maxtext 0.2.5"

  def probe(self, config):
    return [Probe("engine: MaxTextTrainingEngine._prepare_batch", self.probes_ok, "missing")]


@pytest.fixture
def hosts(monkeypatch):
  """tunix's adapter and MaxText's, each its own (the `host` fixture serves one for both)."""
  adapters = {"tunix": Adapter(), "maxtext": MaxTextAdapter()}
  monkeypatch.setattr(entry_points, "load_adapter", lambda name: adapters[name])
  return adapters


@pytest.mark.parametrize("maxtext", ["absent", "present"])
def test_doctor_reports_maxtext_when_tunix_is_not_importable(hosts, capsys, maxtext):
  hosts["tunix"].importable = False
  hosts["maxtext"].importable = maxtext == "present"
  code, out = doctor(capsys)
  assert code == 0
  assert "host: tunix not importable" in out.out
  if maxtext == "absent":
    assert ("engine maxtext: not importable (ModuleNotFoundError: No module named 'maxtext'); "
            "optional") in out.out.splitlines()
  else:
    assert "engine maxtext: maxtext 0.2.5" in out.out.splitlines()
    assert "  [ok] engine: MaxTextTrainingEngine._prepare_batch" in out.out.splitlines()
  report = json.loads(doctor(capsys, "--json")[1].out)
  assert set(report["engines"]) == {"maxtext"}
  assert (report["engines"]["maxtext"]["host"] is None) == (maxtext == "absent")
