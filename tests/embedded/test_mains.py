"""The two process entry points a launch recipe calls: trainer_main and orchestrator_main."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from tests.embedded.support import call
from tunix_stage_plugin.core import install_hint
from tunix_stage_plugin.lab.embedded import process as process_lib

ORCH = [sys.executable, "-m", "tunix_stage_plugin.lab.embedded.orchestrator_main"]
TRAINER = [sys.executable, "-m", "tunix_stage_plugin.lab.embedded.trainer_main"]
STAGING_ENV = ("TUNIX_STAGE_BATCH", "TUNIX_MAX_STAGED_BATCHES", "TUNIX_STAGE_MAX_DEVICE_BATCHES")


def _env(**values: str) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in STAGING_ENV}
  env.update(values)
  return env


def _orchestrate(address: str, *args: str, **env: str) -> subprocess.CompletedProcess:
  return subprocess.run([*ORCH, "--trainer", address, "--tiny", "--steps", "2",
                         "--microbatches", "3", *args], env=_env(**env), capture_output=True,
                        text=True, timeout=120)


def _digest(stdout: str) -> str:
  return re.search(r"param_digest ([0-9a-f]{16})", stdout).group(1)


def test_staged_and_inline_orchestrators_against_one_trainer_then_sigterm():
  with process_lib.TrainerProcess(extra_args=["--fail_stage_ids", "s1-m1"]) as trainer:
    staged = _orchestrate(trainer.address, TUNIX_STAGE_BATCH="stage")
    inline = _orchestrate(trainer.address, "--stage_train_batches", "off",
                          TUNIX_STAGE_BATCH="stage")  # the flag beats the env
    assert call(trainer.address, "info")["staged_keys"] == []
  assert trainer.proc.returncode == 0
  assert staged.returncode == 0, staged.stderr
  summary = staged.stdout.strip().splitlines()[-1]
  assert summary.startswith("orchestrator_main: OK: 2 steps x 3 micro-batches, staging stage "
                            "depth=auto (per step [2, 2]) prestage=on, trainer staging stage")
  assert "stage/fallbacks per step [0, 1]" in summary  # s1-m1 failed in the worker
  assert "trained once in order: yes" in summary
  assert len(staged.stdout.strip().splitlines()) == 3  # a line per step, then the summary
  assert inline.returncode == 0, inline.stderr
  assert "staging off (inline)" in inline.stdout
  assert "stage/fallbacks per step [0, 0]" in inline.stdout
  assert _digest(inline.stdout) == _digest(staged.stdout)


def test_both_off_is_a_plain_inline_trainer():
  with process_lib.TrainerProcess(mode="off") as trainer:
    result = _orchestrate(trainer.address, TUNIX_STAGE_BATCH="off")
    threads = call(trainer.address, "info")["threads"]
  assert result.returncode == 0, result.stderr
  assert "staging off (inline), trainer staging off" in result.stdout
  assert not any("staging" in t for t in threads), threads
  assert trainer.proc.returncode == 0


def test_trainer_main_prints_ready_and_exits_zero_on_sigint():
  proc = subprocess.Popen([*TRAINER, "--port", "0"], stdout=subprocess.PIPE, text=True,
                          env=_env(TUNIX_STAGE_BATCH="stage", TUNIX_STAGE_MAX_DEVICE_BATCHES="3"))
  try:
    line = proc.stdout.readline()
    assert re.fullmatch(r"READY 127\.0\.0\.1:\d+\n", line), line
    info = call(line.split()[1], "info")
    assert info["mode"] == "stage" and info["max_device_batches"] == 3
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    proc.stdout.close()


def test_a_trainer_that_exits_before_ready_is_reported_with_its_exit_code():
  with pytest.raises(process_lib.TrainerProcessError, match="exited with code 2 before READY"):
    process_lib.TrainerProcess(extra_args=["--stage_max_device_batches", "0"])


@pytest.mark.parametrize("cmd, env, code, message", [
    (TRAINER + ["--port", "0"], {"TUNIX_STAGE_MAX_DEVICE_BATCHES": "0"}, 2,
     "TUNIX_STAGE_MAX_DEVICE_BATCHES='0' is invalid; accepted: an integer >= 1"),
    (TRAINER + ["--port", "0", "--stage_max_device_batches", "x"], {}, 2,
     "--stage_max_device_batches='x' is invalid"),
    (ORCH + ["--trainer", "127.0.0.1"], {}, 2,
     "--trainer='127.0.0.1' is invalid; accepted: HOST:PORT with PORT in 1..65535"),
    (ORCH + ["--trainer", "127.0.0.1:1", "--connect_timeout_s", "1"], {}, 1,
     "trainer at 127.0.0.1:1 did not answer"),
    (ORCH + ["--trainer", "127.0.0.1:1"], {"TUNIX_MAX_STAGED_BATCHES": "two"}, 2,
     "TUNIX_MAX_STAGED_BATCHES='two' is invalid"),
    (ORCH + ["--trainer", "127.0.0.1:1", "--liveness_s", "0.5"], {}, 2,
     "--liveness_s='0.5' is invalid; accepted: a number >= 1"),
    (TRAINER + ["--port", "0", "--shutdown_grace_s", "-1"], {}, 2,
     "argument --shutdown_grace_s: '-1' is invalid; accepted: a number >= 0"),
    (TRAINER + ["--port", "0", "--max_call_mib", "0"], {}, 2,
     "argument --max_call_mib: '0' is invalid; accepted: an integer >= 1 and <= "),
    # stdin is /dev/null here: nothing to watch for the parent's death.
    (TRAINER + ["--port", "0", "--exit_with_parent", "pipe"], {}, 2,
     "--exit_with_parent pipe/both: stdin must be a pipe from the parent process"),
])
def test_bad_settings_and_an_absent_trainer_fail_with_a_clear_message(cmd, env, code, message):
  result = subprocess.run(cmd, env=_env(**env), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == code, result.stderr
  assert message in result.stderr


def test_orchestrator_main_reports_every_bad_flag_before_connecting():
  with socket.socket() as listener:  # a "trainer" that records whether anyone connected
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    result = subprocess.run(
        [*ORCH, "--trainer", address, "--steps", "99999999999999999999999", "--microbatches",
         "0", "--payload_mib", "1e-30", "--seed", "-1", "--sync_s", "-1", "--wire_mbps", "inf",
         "--h2d_mbps", "0", "--connect_timeout_s", "x", "--max_staged_batches", "0"],
        env=_env(TUNIX_STAGE_BATCH="maybe"), capture_output=True, text=True, timeout=60)
    with pytest.raises(BlockingIOError):
      listener.accept()
  assert result.returncode == 2, result.stderr
  expected = [
      "--steps='99999999999999999999999' is invalid; accepted: an integer >= 1 and <= 1000000",
      "--microbatches='0' is invalid; accepted: an integer >= 1 and <= 1000000",
      "--payload_mib='1e-30' is invalid; accepted: a size in MiB from 1/1024 (1 KiB)",
      "--wire_mbps='inf' is invalid; accepted: a number > 0",
      "--h2d_mbps='0' is invalid; accepted: a number > 0",
      "--sync_s='-1' is invalid; accepted: a number >= 0",
      "--seed='-1' is invalid; accepted: an integer >= 0 and <= 4294967295",
      "--connect_timeout_s='x' is invalid; accepted: a number > 0",
      "TUNIX_STAGE_BATCH='maybe' is invalid; accepted: off | stage",
      "--max_staged_batches='0' is invalid; accepted: auto, or an integer >= 1",
  ]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == len(expected), result.stderr
  for line, want in zip(lines, expected):
    assert line.startswith(f"orchestrator_main: error: {want}"), (line, want)


def test_orchestrator_main_refuses_a_payload_that_cannot_fit():
  result = subprocess.run([*ORCH, "--trainer", "127.0.0.1:9", "--payload_mib", "65536",
                           "--microbatches", "1000"], env=_env(), capture_output=True, text=True,
                          timeout=60)
  assert result.returncode == 2
  assert ("1000 micro-batches of 65536 MiB held at once (one per position of a step, "
          "--microbatches)") in result.stderr
  assert "(MemAvailable); accepted: at most " in result.stderr and " MiB per micro-batch" in (
      result.stderr)


def _peak_rss_mib(address: str, steps: int, tmp_path) -> float:
  """Runs orchestrator_main to the end; its peak RSS from wait4 (the kernel's VmHWM)."""
  log = tmp_path / f"steps{steps}.log"
  with open(log, "w", encoding="utf-8") as out:
    proc = subprocess.Popen(
        [*ORCH, "--trainer", address, "--tiny", "--payload_mib", "8", "--steps", str(steps),
         "--microbatches", "4", "--stage_train_batches", "stage"], env=_env(), stdout=out,
        stderr=subprocess.STDOUT)
  try:
    _, status, usage = os.wait4(proc.pid, 0)
  finally:
    proc.returncode = -1  # reaped above: Popen must not wait for it again
  assert os.waitstatus_to_exitcode(status) == 0, log.read_text()
  assert f"OK: {steps} steps x 4 micro-batches" in log.read_text()
  return usage.ru_maxrss / 1024  # KiB on Linux


def test_orchestrator_main_memory_does_not_grow_with_steps(tmp_path):
  with process_lib.TrainerProcess() as trainer:
    few = _peak_rss_mib(trainer.address, 2, tmp_path)
    many = _peak_rss_mib(trainer.address, 12, tmp_path)
  # Built up front, 10 more steps of 4 x 8 MiB would add 320 MiB.
  assert many < few + 48, (few, many)


def test_orchestrator_main_rl_payload_with_a_codec_trains_as_inline():
  """The codec extra where installed; without it the codec run must refuse in one line (exit 2)."""
  from tunix_stage_plugin.core import codec as codec_lib  # pylint: disable=import-outside-toplevel
  with process_lib.TrainerProcess() as trainer:
    inline = _orchestrate(trainer.address, "--payload", "rl", "--payload_mib", "1",
                          TUNIX_STAGE_BATCH="off")
    packed = _orchestrate(trainer.address, "--payload", "rl", "--payload_mib", "1",
                          "--stage_codec", "on", TUNIX_STAGE_BATCH="stage")
  assert trainer.proc.returncode == 0
  assert inline.returncode == 0, inline.stderr
  if not codec_lib.installed(codec_lib.DEFAULT_CODEC):
    assert packed.returncode == 2
    assert packed.stderr.strip().splitlines() == [
        "orchestrator_main: error: --stage_codec='on' is invalid: codec blosc2-zstd needs the "
        "Python package blosc2, which is not installed (the 'codec' extra: "
        f"{install_hint.install_command('codec')}); accepted: {codec_lib.ACCEPTED}"]
    return
  assert packed.returncode == 0, packed.stderr
  summary = packed.stdout.strip().splitlines()[-1]
  assert "codec=blosc2-zstd:1 (stage bytes sent " in summary
  assert "stage/fallbacks per step [0, 0]" in summary
  assert _digest(packed.stdout) == _digest(inline.stdout)
