"""The trainer process under signals, a dead parent, a frozen peer and oversized calls.

Real trainer_main processes, real signals and real gRPC; every wait is a bounded poll on /proc, a
pipe or an exit status. docs/embedded.md "Stopping the trainer", "Liveness bound", "Limits of one
call".
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import selectors
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Iterator

import numpy as np
import pytest

from tests import procs
from tests.embedded.support import (bulk_frame, bulk_header, call, process_state, raw_bulk_call,
                                    wait_for)
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.lab import rss
from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import process as process_lib

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="needs Linux /proc and prctl")

MIB = 1 << 20
_PR_SET_CHILD_SUBREAPER = 36
COMPUTE_THREAD = "trainer-compute_0"


def _peak_bytes(pid: int) -> int:
  peak = rss.status_bytes("VmHWM", pid)
  assert peak is not None, f"no VmHWM in /proc/{pid}/status"
  return peak


def _reap(pid: int) -> tuple[int, int] | None:
  reaped = os.waitpid(pid, os.WNOHANG)
  return reaped if reaped[0] == pid else None


@contextlib.contextmanager
def _subreaper() -> Iterator[None]:
  """Orphans of this test's children come to this process, so it can reap and check them."""
  libc = ctypes.CDLL(None, use_errno=True)
  assert libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
  try:
    yield
  finally:
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


PARENT = """
import sys
from tunix_stage_plugin.lab.embedded import process
trainer = process.TrainerProcess(exit_with_parent=sys.argv[1])
print(trainer.pid, flush=True)
sys.stdin.read()  # until this process is killed
"""


@pytest.mark.parametrize("watch", ["both", "pipe", "signal"])
def test_the_trainer_exits_when_its_parent_is_sigkilled(watch):
  with _subreaper():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, watch], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    trainer_pid = None
    try:
      trainer_pid = int(parent.stdout.readline())
      assert procs.running(trainer_pid)
      parent.kill()  # SIGKILL: no cleanup runs in the parent
      parent.wait(20)
      # The orphaned trainer is now this process's child: reap it and read its exit status.
      reaped = wait_for(lambda: _reap(trainer_pid), 20,
                         f"trainer {trainer_pid} exiting after its parent ({watch}) was killed")
      assert os.waitstatus_to_exitcode(reaped[1]) == 0  # it stopped in order, as on SIGTERM
      trainer_pid = None
    finally:
      if parent.poll() is None:
        parent.kill()
        parent.wait()
      parent.stdin.close()
      parent.stdout.close()
      if trainer_pid is not None and procs.running(trainer_pid):
        os.kill(trainer_pid, signal.SIGKILL)
        os.waitpid(trainer_pid, 0)


@contextlib.contextmanager
def _held_in_weight_sync(trainer: process_lib.TrainerProcess,
                         seconds: float = 60.0) -> Iterator[list[BaseException]]:
  """A 60 s weight_sync running on the trainer's compute lane, called from a background thread."""
  errors: list[BaseException] = []

  def run() -> None:
    async def go() -> None:
      async with client_lib.WorkerClient(trainer.address) as client:
        await client.call("weight_sync", seconds)
    try:
      asyncio.run(go())
    except Exception as e:  # pylint: disable=broad-except  (checked by the test)
      errors.append(e)

  thread = threading.Thread(target=run, name="weight-sync-caller")
  thread.start()
  try:
    wait_for(lambda: COMPUTE_THREAD in call(trainer.address, "info")["threads"], 20,
              "the weight sync reaching the compute lane")
    yield errors
  finally:
    if trainer.proc.poll() is None:
      trainer.kill()
    thread.join(30)
    assert not thread.is_alive(), "the caller of a dead trainer never returned"


def _log(path: str) -> str:
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def test_sigterm_during_a_long_weight_sync_exits_after_the_grace_and_says_so():
  with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
    trainer = process_lib.TrainerProcess(stderr=log)
    with _held_in_weight_sync(trainer) as errors:
      start = time.monotonic()
      trainer.proc.send_signal(signal.SIGTERM)
      wait_for(lambda: trainer.proc.poll() is not None, 10, "exit after SIGTERM")
      took = time.monotonic() - start
    assert trainer.proc.returncode == 3, _log(log.name)
    assert "abandoned the calls still running on the compute lane(s) after the 2 s shutdown " \
           "grace; exiting 3" in _log(log.name)
    assert took < 10
    assert "Traceback" not in _log(log.name)  # the abandoned call is one line, not a crash
    assert len(errors) == 1 and isinstance(errors[0], client_lib.TrainerGoneError), errors
    assert str(errors[0]).startswith(f"trainer at {trainer.address} went away during weight_sync")
    assert not procs.running(trainer.pid)


def test_a_second_signal_while_stopping_exits_at_once():
  with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
    trainer = process_lib.TrainerProcess(
        extra_args=["--shutdown_grace_s", "60", "--log_level", "INFO"], stderr=log)
    with _held_in_weight_sync(trainer):
      trainer.proc.send_signal(signal.SIGTERM)
      wait_for(lambda: "stopping: SIGTERM received" in _log(log.name), 10, "the first signal")
      trainer.proc.send_signal(signal.SIGINT)
      wait_for(lambda: trainer.proc.poll() is not None, 10, "exit after a second signal")
    assert trainer.proc.returncode == 128 + signal.SIGINT, _log(log.name)
    assert "second SIGINT while stopping: exiting now (130)" in _log(log.name)


def test_stop_kills_a_trainer_that_outlasts_the_wait():
  trainer = process_lib.TrainerProcess(extra_args=["--shutdown_grace_s", "60"])
  with _held_in_weight_sync(trainer):
    with pytest.raises(process_lib.TrainerProcessError,
                       match=f"trainer {trainer.pid} did not exit within 1 s of SIGTERM; killed"):
      trainer.stop(timeout_s=1)
    assert trainer.proc.returncode == -signal.SIGKILL
  assert not procs.running(trainer.pid)
  assert trainer.stop() == -signal.SIGKILL  # idempotent


def test_a_stopped_trainer_is_reported_within_the_liveness_bound():
  trainer = process_lib.TrainerProcess()
  address = trainer.address
  big = np.zeros(20 * MIB, np.uint8)  # a streamed call

  took = []

  async def scenario() -> list[Any]:
    async with client_lib.WorkerClient(address, liveness_s=3) as client:
      await client.call("heartbeat")
      os.kill(trainer.pid, signal.SIGSTOP)
      wait_for(lambda: process_state(trainer.pid) == "T", 10, "the trainer stopping")
      # An open connection: a unary call and a bulk call (its bytes' send blocked) in flight.
      start = time.monotonic()
      answers = await asyncio.wait_for(asyncio.gather(
          client.call("heartbeat"), client.call("fwd_bwd", big), return_exceptions=True), 20)
      took.append(time.monotonic() - start)
      # A call made after that: the short deadline of the cleanup after a dead peer.
      start = time.monotonic()
      answers += await asyncio.gather(client.call("reset_staged", ["k"]), return_exceptions=True)
      took.append(time.monotonic() - start)
    # A new connection to the frozen trainer: it never comes up.
    async with client_lib.WorkerClient(address, liveness_s=3) as fresh:
      start = time.monotonic()
      answers += await asyncio.wait_for(asyncio.gather(fresh.call("update"),
                                                       return_exceptions=True), 20)
      took.append(time.monotonic() - start)
    return answers

  try:
    answers = asyncio.run(scenario())
  finally:
    os.kill(trainer.pid, signal.SIGCONT)
    code = trainer.stop()
  assert code == 0 and not procs.running(trainer.pid)
  for method, answer in zip(["heartbeat", "fwd_bwd", "reset_staged", "update"], answers):
    assert isinstance(answer, client_lib.TrainerUnresponsiveError), (method, answer)
    text = str(answer)
    assert text.startswith(f"trainer at {address} stopped answering: {method} "), text
    assert text.endswith("(liveness bound 3 s, --liveness_s)"), text
    assert "\n" not in text
  for answer in answers[:2] + answers[3:]:  # the watchdog: a quarter bound quiet, a quarter to answer
    assert "and a heartbeat then got none within 0.75 s" in str(answer), answer
  assert "got no reply within 1 s, the deadline of a call made after" in str(answers[2])
  # The contract (docs/embedded.md "Liveness bound"): within about half the bound, cleanup within
  # its own second. The margins are for a loaded 2-core machine.
  assert took[0] < 1.5 + 1 and took[2] < 1.5 + 1, took
  assert took[1] < client_lib.DEAD_PEER_DEADLINE_S + 0.5, took


def test_an_oversized_or_mismatched_call_is_refused_before_its_bytes_are_read():
  with process_lib.TrainerProcess(extra_args=["--max_call_mib", "8"]) as trainer:
    warm = secrets.token_bytes(16)
    # A well-formed call first, so the peak below counts only what the refusals cost.
    reply = asyncio.run(raw_bulk_call(trainer.address, bulk_header("heartbeat", [MIB], warm),
                                       bulk_frame(warm, [MIB], bytes(MIB))))
    assert reply["pid"] == trainer.pid
    peak_before = _peak_bytes(trainer.pid)
    big = secrets.token_bytes(16)
    with pytest.raises(contract.RemoteError, match=r"heartbeat announces 9437184 bytes "
                       r"\(9.0 MiB\), above this trainer's 8388608-byte cap on one call "
                       r"\(trainer_main --max_call_mib\); refused before reading any of its bytes"):
      asyncio.run(raw_bulk_call(trainer.address, bulk_header("heartbeat", [9 * MIB], big),
                                 bulk_frame(big, [9 * MIB], bytes(9 * MIB))))
    # A frame announcing more than its call's header (the bytes of an overrun): refused by its
    # frame header, before a buffer is made for it.
    lying = secrets.token_bytes(16)
    with pytest.raises(contract.RemoteError, match=r"\[WireError\]: the bulk frame announced "
                       r"buffer sizes \[268435456\] where the call's header announced \[1\]"):
      asyncio.run(raw_bulk_call(trainer.address, bulk_header("heartbeat", [1], lying),
                                 bulk_frame(lying, [256 * MIB], bytes(16 * MIB))))
    grown_mib = (_peak_bytes(trainer.pid) - peak_before) / (1 << 20)
    assert grown_mib < 16, f"peak RSS grew {grown_mib:.0f} MiB for refused calls"
    assert call(trainer.address, "heartbeat")["pid"] == trainer.pid  # still serving
  assert trainer.proc.returncode == 0


ORCHESTRATOR = [sys.executable, "-m", "tunix_stage_plugin.lab.embedded.orchestrator_main"]


def _orchestrator(address: str, *args: str) -> subprocess.Popen:
  return subprocess.Popen([*ORCHESTRATOR, "--trainer", address, "--tiny",
                           "--stage_train_batches", "stage", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_steps(proc: subprocess.Popen, steps: int, timeout_s: float) -> None:
  """Reads the orchestrator's stdout until it printed `steps` step lines (bounded)."""
  seen, deadline = 0, time.monotonic() + timeout_s
  with selectors.DefaultSelector() as sel:
    sel.register(proc.stdout, selectors.EVENT_READ)
    while seen < steps:
      remaining = deadline - time.monotonic()
      if remaining <= 0 or not sel.select(remaining):
        raise AssertionError(f"orchestrator printed {seen} step lines within {timeout_s:g} s")
      line = proc.stdout.readline()
      if not line:
        raise AssertionError(f"orchestrator ended after {seen} step lines: {proc.stderr.read()}")
      seen += line.startswith("orchestrator_main: step ")


def test_orchestrator_main_reports_a_sigstopped_trainer_within_the_liveness_bound():
  """A trainer frozen mid-job (SIGSTOP after two steps): the orchestrator exits 1 with one line
  naming it within half the bound, plus a second for the cleanup reset (docs/embedded.md "Liveness
  bound"; the default 60 s bound measured by hand there). Before: each call in flight waited its
  whole deadline (2 s + the bound) and the cleanup reset another."""
  with process_lib.TrainerProcess() as trainer:
    warm = _orchestrator(trainer.address, "--steps", "1")  # JAX compiles at the default bound
    out, err = warm.communicate(timeout=120)
    assert warm.returncode == 0, err
    for bound in (3, 6):
      orch = _orchestrator(trainer.address, "--steps", "100000", "--liveness_s", str(bound))
      try:
        _read_steps(orch, 2, 60)
        os.kill(trainer.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(trainer.pid) == "T", 10, "the trainer stopping")
        start = time.monotonic()
        code = orch.wait(bound + 30)
        took = time.monotonic() - start
        err = orch.stderr.read()
      finally:
        os.kill(trainer.pid, signal.SIGCONT)
        if orch.poll() is None:
          orch.kill()
          orch.wait()
        orch.stdout.close()
        orch.stderr.close()
      lines = err.strip().splitlines()
      assert code == 1, err
      errors = [line for line in lines if line.startswith("orchestrator_main: error:")]
      assert errors == lines[-1:], err  # one error line, the last
      assert errors[0].startswith(f"orchestrator_main: error: trainer at {trainer.address} "
                                  "stopped answering: "), err
      assert errors[0].endswith(f"(liveness bound {bound} s, --liveness_s)"), err
      # What else it may print: each finished step's line, the cleanup reset that could not
      # reach the frozen trainer.
      assert all(line.startswith(("could not reset staged keys", "tunix-stage: step "))
                 for line in lines[:-1]), err
      assert "Traceback" not in err
      budget = bound / 2 + client_lib.DEAD_PEER_DEADLINE_S
      assert took < budget + 1.5, (bound, took, err)  # the margin: a loaded 2-core machine
  assert trainer.proc.returncode in (0, 3)
