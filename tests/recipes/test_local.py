"""recipes/local_launcher.sh: a tiny job end to end on this machine, and its failure paths.

Real subprocesses, no cluster and no kubectl. Every run gets a unique marker variable in its
environment, which every process it starts inherits; after the launcher exits, /proc is scanned
for that marker, so a process left behind (a child or a grandchild) fails the test. PIDs the
launcher reports ("started NAME pid=N") are checked too. Nothing waits on a sleep: the tests
wait for the launcher's exit, or read its output line by line.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from tests import procs

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "recipes" / "local_launcher.sh"
VENV_BIN = Path(sys.executable).parent
MARKER_VAR = "TSP_RECIPE_TEST_MARKER"  # (a TUNIX_STAGE_* name would be warned about)
TUNIX_RUNTIME = "tunix.experimental.distributed.runtime.main"


@functools.cache  # (the environment does not change during a session)
def _importable(module: str) -> bool:
  proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                        check=False)
  return proc.returncode == 0


def processes_with(marker: str) -> list[int]:
  """PIDs of the live processes whose environment holds `marker`."""
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      environ = Path(f"/proc/{entry}/environ").read_bytes()
    except OSError:
      continue
    if f"{MARKER_VAR}={marker}".encode() in environ.split(b"\0"):
      found.append(int(entry))
  return found


def reported_pids(output: str) -> dict[str, int]:
  return {m[1]: int(m[2]) for m in re.finditer(r"started (\w+) pid=(\d+)", output)}


@pytest.fixture
def launch(tmp_path: Path):
  """Runs the launcher with a fresh environment and a unique marker; yields a runner.

  At teardown, kills whatever still carries the marker (only processes these tests started)
  so that a failing test does not leave a trainer running.
  """
  marker = uuid.uuid4().hex
  env = {
      "PATH": os.pathsep.join([str(VENV_BIN), "/usr/local/bin", "/usr/bin", "/bin"]),
      "HOME": str(tmp_path),
      "TMPDIR": str(tmp_path),
      "LANG": "C.UTF-8",
      "PYTHON": sys.executable,
      "JAX_PLATFORMS": "cpu",
      MARKER_VAR: marker,
  }

  def runner(*args: str, timeout: float = 60, **overrides: str):
    return subprocess.run(["bash", str(LOCAL), *args], env={**env, **overrides}, cwd=tmp_path,
                          text=True, capture_output=True, timeout=timeout, check=False)

  runner.marker = marker
  runner.env = env
  yield runner
  for pid in processes_with(marker):
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def _cmdline(pid: int) -> str:
  try:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
  except OSError:
    return "?"


def assert_nothing_left(launch, output: str) -> None:
  left = processes_with(launch.marker)
  assert left == [], [(pid, _cmdline(pid)) for pid in left]
  for name, pid in reported_pids(output).items():
    assert not procs.running(pid), f"{name} pid={pid} is still running"


def test_local_host_tunix_says_when_tunix_is_not_installed(launch):
  if _importable(TUNIX_RUNTIME):
    pytest.skip("tunix's runtime is installed here; this checks the message without it")
  proc = launch("--host", "tunix", "--steps", "1")
  assert proc.returncode == 2
  assert proc.stderr.strip() == (
      f"local_launcher.sh: error: tunix's distributed runtime is not installed for "
      f"{sys.executable} ('import {TUNIX_RUNTIME}' failed); install tunix, or use --host embedded")
  assert "started" not in proc.stdout
  assert_nothing_left(launch, proc.stdout)


@pytest.mark.parametrize("var, value", [("TUNIX_STAGE_BATCH", "yes"),
                                        ("TUNIX_MAX_STAGED_BATCHES", "0")])
def test_local_bad_value_stops_before_starting_anything(launch, tmp_path: Path, var, value):
  proc = launch("--host", "embedded", "--log_dir", str(tmp_path / "logs"), **{var: value})
  assert proc.returncode == 2
  assert f"mlperf_base.sh: error: invalid staging setting: {var}={value!r} is invalid" \
      in proc.stderr
  assert proc.stdout == ""
  assert not (tmp_path / "logs").exists()
  assert_nothing_left(launch, proc.stdout)


# A job that cannot finish for hours: 2 MiB micro-batches (above the wire's 1 MiB stream threshold,
# so each is a streamed call, paced: a 1 MiB payload went as one unpaced message and the job
# ended in 7 s) over an emulated 10 kB/s wire, about 210 s each, 50 steps of 4. The pacing is in
# the orchestrator, so the trainer stays free to stop at once. The tests that stop it check that
# it had not finished (job_finished).
SLOW_JOB = ("--", "--payload_mib", "2", "--wire_mbps", "0.01", "--steps", "50")
# The job's summary (the embedded orchestrator's or tunix's small job's), printed at its end.
SUMMARY = re.compile(r"^(orchestrator_main|tunix_job): (OK|FAILED): ", re.M)


def job_finished(logs: Path) -> bool:
  """Whether the orchestrator printed its summary line (it prints it only at the job's end)."""
  log = logs / "orchestrator.log"
  return log.exists() and SUMMARY.search(log.read_text()) is not None


@pytest.mark.parametrize("mode", ["stage", "off"])
def test_local_tiny_job_end_to_end_leaves_nothing_behind(launch, tmp_path: Path, mode: str):
  logs = tmp_path / "logs"
  # One run goes through --host auto, which picks the embedded host where tunix is missing.
  auto = mode == "off" and not _importable(TUNIX_RUNTIME)
  # Leading zeros are decimal, never octal in the launcher's arithmetic ("090" is not octal).
  numbers = (("--steps", "02", "--microbatches", "03", "--timeout", "090") if mode == "stage"
             else ("--steps", "2", "--microbatches", "3", "--timeout", "50"))
  proc = launch(*(() if auto else ("--host", "embedded")), *numbers, "--tiny", "--log_dir",
                str(logs), TUNIX_STAGE_BATCH=mode)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  out = proc.stdout
  assert out.startswith(f"local_launcher.sh: host=embedded python={sys.executable} logs={logs}\n")
  assert set(reported_pids(out)) == {"trainer", "orchestrator"}
  # Each process got its role's staging variables, as its container would.
  assert (f"started trainer pid={reported_pids(out)['trainer']} log={logs}/trainer.log "
          f"env: TUNIX_STAGE_BATCH={mode} TUNIX_STAGE_MAX_DEVICE_BATCHES=1") in out
  assert (f"started orchestrator pid={reported_pids(out)['orchestrator']} "
          f"log={logs}/orchestrator.log env: TUNIX_STAGE_BATCH={mode} "
          f"TUNIX_MAX_STAGED_BATCHES=auto") in out
  assert re.search(r"trainer ready on 127\.0\.0\.1:\d+\n", out)
  assert f"job succeeded; logs in {logs}" in out
  assert re.search(r"^READY 127\.0\.0\.1:\d+$", (logs / "trainer.log").read_text(), re.M)
  summary = (logs / "orchestrator.log").read_text()
  assert job_finished(logs)  # what the slow job's tests rely on: the summary marks the end
  assert "OK: 2 steps x 3 micro-batches" in summary
  assert "trained once in order: yes" in summary
  # Both processes run in the mode the launcher set.
  if mode == "stage":
    assert "staging stage depth=auto (per step [2, 2])" in summary and "trainer staging stage" in summary
  else:
    assert "staging off (inline)" in summary and "trainer staging off" in summary
  assert_nothing_left(launch, out)


# Execs its arguments with SIGINT and SIGTERM back at their defaults. A suite started with them
# ignored (a background job: `nohup ... &`, `trap '' INT`) passes the ignore on to every child,
# and bash cannot trap a signal ignored when it starts; the launcher of a user's terminal has
# them at their defaults. A process of its own, not a preexec_fn: that would make subprocess
# fork() this multithreaded test process, and the gRPC left loaded here by other tests runs its
# fork handlers in the child, which then can die before it execs (seen once in CI: the launcher
# "ended" with only gRPC's epoll error on its output).
# SIGPIPE and SIGXFSZ too: Python ignores them itself, and an exec keeps what is ignored.
DEFAULT_STOP_SIGNALS = [sys.executable, "-c",
                        "import os, signal, sys\n"
                        "for s in signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ:\n"
                        "  signal.signal(s, signal.SIG_DFL)\n"
                        "os.execvp(sys.argv[1], sys.argv[1:])"]


def _start_and_signal(launch, tmp_path: Path, sig: int, after: str, *, check_started=None,
                      timeout: float = 60,
                      job: tuple[str, ...] = ("--host", "embedded", "--tiny", "--timeout", "50",
                                              *SLOW_JOB), **env: str):
  """Starts a slow job (`job`: the launcher's arguments), sends `sig` to the launcher once it
  started `after` (first calling `check_started(output so far)` when given); returns (rc, out)
  once the launcher has exited, after checking that the job had not finished: the signal stopped
  a running job."""
  logs = tmp_path / "logs"
  proc = subprocess.Popen(
      [*DEFAULT_STOP_SIGNALS, "bash", str(LOCAL), "--log_dir", str(logs), *job],
      env={**launch.env, "TUNIX_STAGE_BATCH": "stage", **env}, cwd=tmp_path, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  seen = []
  try:
    for line in proc.stdout:
      seen.append(line)
      if line.startswith(f"local_launcher.sh: started {after} pid="):
        break
    else:
      pytest.fail(f"the launcher ended before starting the {after}:\n" + "".join(seen))
    if check_started is not None:
      check_started("".join(seen))
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=timeout)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  out = "".join(seen) + rest
  assert not job_finished(logs), f"the job finished before {signal.Signals(sig).name}:\n{out}"
  assert "job succeeded" not in out
  return proc.returncode, out


@pytest.mark.parametrize("after", ["trainer", "orchestrator"])
def test_local_launcher_stops_everything_when_terminated(launch, tmp_path: Path, after: str):
  """SIGTERM to the launcher once it has started the trainer (it may still be starting up) or
  the orchestrator (the job is running): it exits 143 and stops all it started."""
  def started_and_alive(seen: str) -> None:
    assert all(procs.running(pid) for pid in reported_pids(seen).values())

  rc, out = _start_and_signal(launch, tmp_path, signal.SIGTERM, after,
                              check_started=started_and_alive, timeout=30)
  assert rc == 143, out
  assert set(reported_pids(out)) == ({"trainer", "orchestrator"} if after == "orchestrator"
                                     else {"trainer"})
  for name in reported_pids(out):
    assert re.search(rf"stopped {name} pid=\d+", out)
  assert "job failed (exit 143)" in out
  assert_nothing_left(launch, out)


def test_local_timeout_stops_the_job_and_prints_the_logs(launch, tmp_path: Path):
  logs = tmp_path / "logs"
  proc = launch("--host", "embedded", "--tiny", "--timeout", "4", "--log_dir", str(logs),
                *SLOW_JOB)
  assert not job_finished(logs), proc.stdout + proc.stderr  # the timeout stopped a running job
  assert proc.returncode == 1
  assert "local_launcher.sh: error: the job did not finish within 4s" in proc.stderr
  assert re.search(r"^----- trainer \(.*/trainer\.log\), last 40 lines -----$", proc.stderr,
                   re.M)
  assert "READY 127.0.0.1:" in proc.stderr  # the trainer log's tail
  assert "job failed (exit 1)" in proc.stderr
  assert_nothing_left(launch, proc.stdout)


def test_local_trainer_that_cannot_start_fails_with_its_log(launch):
  with socket.socket() as busy:  # the requested port is taken
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    proc = launch("--host", "embedded", "--tiny", "--port", str(port), "--timeout", "50")
  assert proc.returncode == 1
  assert "local_launcher.sh: error: trainer exited before it was ready" in proc.stderr
  assert "----- trainer (" in proc.stderr
  assert str(port) in proc.stderr.split("----- trainer (", 1)[1]  # the bind error, from its log
  assert "started orchestrator" not in proc.stdout
  assert_nothing_left(launch, proc.stdout)


def test_local_launcher_ctrl_c_is_one_clean_stop(launch, tmp_path: Path):
  rc, out = _start_and_signal(launch, tmp_path, signal.SIGINT, "orchestrator")
  assert rc == 130, out
  assert out.count("local_launcher.sh: interrupted by SIGINT; stopping every process it started"
                   ) == 1
  for name in ("trainer", "orchestrator"):
    assert re.search(rf"stopped {name} pid=\d+", out), out
  assert "SIGKILL" not in out
  assert "job failed (exit 130)" in out
  assert_nothing_left(launch, out)


# A python for the launcher whose trainer leaves a child that ignores SIGTERM in its process group
# (as a trainer stuck in a C call would): the launcher must escalate to SIGKILL and say so.
STUBBORN_PYTHON = """#!/bin/bash
case " $* " in
  *" -m tunix_stage_plugin.lab.embedded.trainer_main "*)
    (trap '' TERM; exec "{python}" -c 'import signal; signal.pause()') &
    ;;
esac
exec "{python}" "$@"
"""


def test_local_launcher_kills_what_ignores_sigterm_and_says_so(launch, tmp_path: Path):
  python = tmp_path / "stubborn-python"
  python.write_text(STUBBORN_PYTHON.format(python=sys.executable))
  python.chmod(0o755)
  rc, out = _start_and_signal(launch, tmp_path, signal.SIGTERM, "orchestrator",
                              PYTHON=str(python), STOP_GRACE="1")
  assert rc == 143, out
  assert "local_launcher.sh: interrupted by SIGTERM" in out
  assert re.search(r"trainer pid=\d+ ignored SIGTERM for 1s; sending SIGKILL", out), out
  assert "orchestrator pid=" in out and not re.search(r"orchestrator pid=\d+ ignored", out)
  assert_nothing_left(launch, out)  # the stubborn grandchild too


def test_sigkill_to_the_launcher_leaves_no_process_behind(launch, tmp_path: Path):
  """The launcher cannot clean up after SIGKILL: the kernel's parent-death signal (setpriv
  --pdeathsig) stops its processes instead. Polls /proc with a deadline for them to be gone."""
  rc, out = _start_and_signal(launch, tmp_path, signal.SIGKILL, "orchestrator")
  assert rc == -signal.SIGKILL, out
  pids = reported_pids(out)
  assert {"trainer", "orchestrator"} <= set(pids), out
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline and (
      processes_with(launch.marker) or any(procs.running(p) for p in pids.values())):
    time.sleep(0.1)
  assert_nothing_left(launch, out)


@pytest.mark.tunix
@pytest.mark.parametrize("known", [True, False])
def test_local_host_tunix_gives_the_staging_flags_to_a_known_driver_only(launch, tmp_path: Path,
                                                                        known: bool):
  """`--host tunix`: the orchestrator, trainer and rollout processes with the containers'
  arguments (mlperf_base.sh), staging on. The orchestrator's main is the DeepSWE-shaped stand-in
  (tests/drivers.py says why it is not tunix's file): under its real name (a known driver: the
  recipes pass the staging flags, the plugin makes its parser take them), or the same file under
  a name the plugin does not know (no staging flag, the environment only). The trainer's and
  rollout's mains idle until the launcher stops them. RUNTIME_MAIN is tunix's runtime main
  without its process executor (drivers.RUNTIME: tunix's runtime cannot start a process here,
  its discovery protobuf module is not generated in this checkout)."""
  if not _importable(TUNIX_RUNTIME):
    pytest.skip("tunix's distributed runtime is not importable")
  from tests import drivers  # pylint: disable=import-outside-toplevel

  shim = drivers.write_for_tunix(tmp_path / "driver")
  mods = drivers.write_module(tmp_path / "mods", "idle_main", drivers.IDLE)
  drivers.write_module(mods, "my_rl_driver", drivers.source(tunix=True))
  drivers.write_module(mods, "tunix_runtime_one_process", drivers.RUNTIME)
  main = drivers.MAIN if known else "my_rl_driver.main"
  logs = tmp_path / "logs"
  pythonpath = os.pathsep.join([str(shim), str(mods), os.environ.get("PYTHONPATH", "")])
  proc = launch("--host", "tunix", "--steps", "3", "--log_dir", str(logs), "--timeout", "240",
                timeout=300, TUNIX_STAGE_BATCH="stage", TUNIX_MAX_STAGED_BATCHES="3",
                ORCHESTRATOR_MAIN=main, TRAINER_MAIN="idle_main.main",
                ROLLOUT_MAIN="idle_main.main", RUNTIME_MAIN="tunix_runtime_one_process",
                PYTHONPATH=pythonpath)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert set(reported_pids(proc.stdout)) == {"orchestrator", "trainer", "rollout"}
  log = (logs / "orchestrator.log").read_text()
  report = drivers.report(log)
  args = report["args"]
  # mlperf_base.sh's orchestrator arguments reached the driver's own parser.
  assert (args["max_steps"], args["batch_size"], args["stop_workers_on_exit"]) == (3, 8, True)
  assert report["seams"] == [True, True]  # the hooks installed from the environment either way
  assert "tunix-stage: staging on for tunix" in log
  if known:
    assert report["parse_wrapped"]
    assert (args["stage_train_batches"], args["max_staged_batches"]) == ("stage", 3)
  else:  # never an "unrecognized arguments" stop: no flag, the environment only
    assert not report["parse_wrapped"] and "stage_train_batches" not in args
  assert "idle" in (logs / "trainer.log").read_text()
  assert_nothing_left(launch, proc.stdout)


# --- tunix's small job, with tunix's runtime ------------------------------------------------------

TUNIX_EXECUTOR = "tunix.experimental.distributed.runtime.executor"  # imports the generated protos
PROTO = "tunix/experimental/distributed/runtime/discovery/discovery_service.proto"
LAUNCHING = REPO / "docs" / "launching.md"


def documented_tunix_run() -> list[str]:
  """The launcher's lines docs/launching.md shows for its tunix job (a text block)."""
  lines = [line.strip() for line in LAUNCHING.read_text().splitlines()]
  start = lines.index("local_launcher.sh: host=tunix python=/path/to/venv/bin/python "
                      "logs=/tmp/tsl-tunix")
  return lines[start:lines.index("```", start)]


def _tunix_tree() -> Path:
  import tunix  # pylint: disable=import-outside-toplevel
  return Path(os.path.abspath(tunix.__file__)).parents[1]


@pytest.fixture(scope="module")
def tunix_pythonpath(tmp_path_factory) -> str:
  """A PYTHONPATH whose tunix's runtime can start a process: this one where tunix's runtime
  protobuf modules are generated (the patched tree), else a copy of the tunix tree with them
  generated as tunix documents (the tree itself is never written)."""
  if not _importable(TUNIX_RUNTIME):
    pytest.skip("tunix's distributed runtime is not importable")
  pythonpath = os.environ.get("PYTHONPATH", "")
  if _importable(TUNIX_EXECUTOR):
    return pythonpath
  if not _importable("grpc_tools.protoc"):
    pytest.skip("grpcio-tools is not installed: no protoc for tunix's runtime protobuf modules")
  tree, copy = _tunix_tree(), tmp_path_factory.mktemp("tunix-tree")
  shutil.copytree(tree / "tunix", copy / "tunix", ignore=shutil.ignore_patterns("__pycache__"))
  if (tree / ".git").is_dir():  # the commit the plugin reads
    shutil.copytree(tree / ".git", copy / ".git")
  subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                  "--grpc_python_out=.", PROTO], cwd=copy, check=True, capture_output=True)
  return os.pathsep.join([str(copy), pythonpath])


@pytest.mark.tunix
def test_local_host_tunix_says_at_preflight_that_tunix_s_protos_are_missing(launch):
  """c7d8950 as checked out: tunix's runtime cannot start a process (its process executor
  imports protobuf modules generated from a .proto file): one line saying what to run."""
  if not _importable(TUNIX_RUNTIME):
    pytest.skip("tunix's distributed runtime is not importable")
  if _importable(TUNIX_EXECUTOR):
    pytest.skip("tunix's runtime protobuf modules are generated in this tree")
  tree = _tunix_tree()
  proc = launch("--host", "tunix", "--steps", "1", "--tiny",
                PYTHONPATH=os.environ.get("PYTHONPATH", ""))
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert proc.stderr.splitlines() == [
      "local_launcher.sh: error: tunix's runtime cannot start a process: its discovery service's "
      f"protobuf modules are not generated in {tree}; generate them as tunix documents "
      "(tunix/experimental/distributed/examples/README.md): "
      f"cd {tree} && {sys.executable} -m grpc_tools.protoc -I. --python_out=. "
      f"--grpc_python_out=. {PROTO}"]
  assert "started" not in proc.stdout
  assert_nothing_left(launch, proc.stdout)


@pytest.mark.tunix
def test_local_host_tunix_runs_tunix_s_small_job_staged_and_report_reads_it(
    launch, tmp_path: Path, tunix_pythonpath: str):
  """`--host tunix`, nothing else named: tunix's runtime runs the plugin's small job (an
  orchestrator running tunix's train loop, a trainer node serving tunix's TrainerWorker and
  PeftTrainer), staged by the plugin from the environment alone, as docs/launching.md shows it.
  Each process prints its per-step line and writes its record; `tunix-stage report` reads the
  two."""
  # pylint: disable=import-outside-toplevel
  from tests.docs.test_documented_commands import _mask  # the docs' samples, masked alike
  from tests.records import job_records
  logs, metrics = tmp_path / "logs", tmp_path / "metrics"
  proc = launch("--host", "tunix", "--steps", "3", "--tiny", "--log_dir", str(logs),
                "--timeout", "240", timeout=300, TUNIX_STAGE_BATCH="stage",
                TUNIX_STAGE_METRICS=str(metrics), PYTHONPATH=tunix_pythonpath)
  out = proc.stdout
  assert proc.returncode == 0, out + proc.stderr
  assert set(reported_pids(out)) == {"orchestrator", "trainer"}  # no rollout model
  # What the docs show it prints (numbers, paths masked): the summary says every step staged.
  assert [_mask(line) for line in out.splitlines()] == \
      [_mask(line) for line in documented_tunix_run()], out
  assert re.search(r"^  tunix_job: OK: 3 steps x 4 micro-batches on tunix's TrainerWorker "
                   r"tunix-mlperf-train at \S+, staging on: stage/staged per step \[[1-4], [1-4], "
                   r"[1-4]\]", out, re.M), out
  orchestrator, trainer = ((logs / f"{name}.log").read_text() for name in ("orchestrator",
                                                                         "trainer"))
  for log in (orchestrator, trainer):  # activated by the environment, in each process
    assert log.count("tunix-stage: staging on for tunix") == 1, log[-3000:]
  # The per-step line, on both processes, for every step.
  for step in range(3):
    assert f"tunix-stage: step {step}: 4 micro-batches, staged " in orchestrator
    assert f"tunix-stage: trainer step {step}: " in trainer
  # The records: one per process, a record per step; the orchestrator staged micro-batches.
  by_role = job_records(metrics)
  assert set(by_role) == {"orchestrator", "trainer"}
  assert all([r["step"] for r in records] == [0, 1, 2] for records in by_role.values())
  staged = sum(r["staged"] for r in by_role["orchestrator"])
  assert staged > 0
  report = subprocess.run([sys.executable, "-m", "tunix_stage_plugin", "report", str(metrics)],
                          capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": tunix_pythonpath})
  assert report.returncode == 0, report.stdout + report.stderr
  assert report.stdout.count("(tunix, 3 steps)") == 2, report.stdout  # trainer, orchestrator
  assert re.search(rf"^  orchestrator: staged {staged} ", report.stdout, re.M), report.stdout
  assert_nothing_left(launch, out)


@pytest.mark.tunix
def test_local_host_tunix_small_job_with_staging_off_is_tunix_alone(launch, tmp_path: Path,
                                                                    tunix_pythonpath: str):
  """Staging off (the default): the same job through tunix's runtime, nothing of the plugin
  said or written in either process, though TUNIX_STAGE_METRICS names a folder."""
  logs, metrics = tmp_path / "logs", tmp_path / "metrics"
  proc = launch("--host", "tunix", "--steps", "1", "--microbatches", "2", "--tiny", "--log_dir",
                str(logs), "--timeout", "240", timeout=300, TUNIX_STAGE_METRICS=str(metrics),
                PYTHONPATH=tunix_pythonpath)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert re.search(r"^  tunix_job: OK: 1 step x 2 micro-batches on tunix's TrainerWorker \S+ at "
                   r"\S+, staging off \(tunix's own train loop\)$", proc.stdout, re.M), proc.stdout
  for name in ("orchestrator", "trainer"):
    assert "tunix-stage" not in (logs / f"{name}.log").read_text(), name
  assert not metrics.exists()
  assert_nothing_left(launch, proc.stdout)


@pytest.mark.tunix
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_local_host_tunix_stops_everything_when_interrupted(launch, tmp_path: Path,
                                                            tunix_pythonpath: str, sig: int):
  """SIGTERM as soon as the trainer started (it is still starting up), SIGINT once the job has
  trained a step: the launcher stops both of tunix's processes and nothing is left."""
  logs = tmp_path / "logs"

  def wait_for_a_step(seen: str) -> None:
    del seen
    if sig == signal.SIGTERM:
      return
    deadline = time.monotonic() + 120
    while "tunix-stage: trainer step 0: " not in (logs / "trainer.log").read_text():
      assert time.monotonic() < deadline, (logs / "trainer.log").read_text()[-3000:]
      time.sleep(0.1)

  rc, out = _start_and_signal(
      launch, tmp_path, sig, "trainer", check_started=wait_for_a_step, timeout=60,
      job=("--host", "tunix", "--tiny", "--steps", "100000", "--timeout", "200"),
      TUNIX_STAGE_BATCH="stage", PYTHONPATH=tunix_pythonpath)
  assert rc == 128 + sig, out
  assert out.count(f"local_launcher.sh: interrupted by {signal.Signals(sig).name}") == 1, out
  for name in ("orchestrator", "trainer"):
    assert re.search(rf"stopped {name} pid=\d+", out), out
  assert "SIGKILL" not in out
  assert_nothing_left(launch, out)
