"""Starting and stopping a trainer process (trainer_main) from the benchmark and the tests.

The child never outlives this process (docs/embedded.md "Stopping the trainer"): it runs in its own
session (a terminal's Ctrl-C reaches only this process, which then stops it in order), it is started
with `--exit_with_parent`, so it stops when this process dies however it died (stdin is a pipe from
here, and Linux sends it SIGTERM when the starting thread exits), and `stop()` ends with SIGKILL
when SIGTERM was not enough.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Mapping, Sequence

from tunix_stage_plugin.core import config as config_lib

READY_PREFIX = "READY "
STOP_TIMEOUT_S = 15.0  # the trainer's 2 s shutdown grace, with room for a loaded machine


class TrainerProcessError(RuntimeError):
  """The trainer process did not come up, or did not exit cleanly."""


class TrainerProcess:
  """A trainer_main child bound to 127.0.0.1; `with` stops it (SIGTERM, bounded wait, SIGKILL).

  PR_SET_PDEATHSIG fires when the *thread* that started the child exits, so off the main thread
  the child only watches its stdin pipe (`--exit_with_parent pipe`).
  """

  def __init__(self, *, max_device_batches: int | None = None,
               max_host_batches: int | str | None = None, mode: str = "stage",
               extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
               ready_timeout_s: float = 120.0, exit_with_parent: str | None = None,
               stderr: IO | None = None, jax_platforms: str | None = None) -> None:
    if exit_with_parent is None:
      on_main = threading.current_thread() is threading.main_thread()
      exit_with_parent = "both" if on_main else "pipe"
    cmd = [sys.executable, "-m", "tunix_stage_plugin.lab.embedded.trainer_main", "--port", "0",
           "--stage_train_batches", mode, "--exit_with_parent", exit_with_parent, *extra_args]
    if max_device_batches is not None:
      cmd += ["--stage_max_device_batches", str(max_device_batches)]
    if max_host_batches is not None:
      cmd += ["--stage_max_host_batches", str(max_host_batches)]
    child_env = dict(os.environ if env is None else env)
    # The trainer's staging settings come from the flags above, not from this process's env.
    for setting in config_lib.SETTINGS:
      if config_lib.TRAINER in setting.roles:
        child_env.pop(setting.env, None)
    if jax_platforms is not None:  # '' lets JAX choose (an accelerator when there is one)
      child_env["JAX_PLATFORMS"] = jax_platforms
    self.cmd = cmd
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=stderr, env=child_env, text=True,
                                 start_new_session=True)
    try:
      self.address = self._wait_ready(ready_timeout_s)
    except BaseException:
      self.kill()
      raise

  def _wait_ready(self, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
      sel.register(self.proc.stdout, selectors.EVENT_READ)
      while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise TrainerProcessError(f"trainer did not print READY within {timeout_s:.0f} s "
                                    f"({' '.join(self.cmd)})")
        if not sel.select(remaining):
          continue
        line = self.proc.stdout.readline()
        if not line:
          code = self.proc.wait()
          raise TrainerProcessError(f"trainer exited with code {code} before READY "
                                    f"({' '.join(self.cmd)}); see its stderr above")
        if line.startswith(READY_PREFIX):
          return line[len(READY_PREFIX):].strip()

  @property
  def pid(self) -> int:
    return self.proc.pid

  def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM, wait up to `timeout_s`, then SIGKILL; returns the exit code. Idempotent.

    0: a clean stop; 3: the trainer abandoned calls still running after its shutdown grace.
    Raises TrainerProcessError (the child is gone by then) when SIGKILL was needed. An
    interrupt (Ctrl-C) during the wait kills the child before it propagates.
    """
    try:
      if self.proc.poll() is None:
        self.proc.send_signal(signal.SIGTERM)
        try:
          self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
          self.kill()
          raise TrainerProcessError(f"trainer {self.pid} did not exit within {timeout_s:g} s "
                                    "of SIGTERM; killed") from None
    except BaseException:
      self.kill()
      raise
    self._close_pipes()
    return self.proc.returncode

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()
    self._close_pipes()

  def _close_pipes(self) -> None:
    for pipe in (self.proc.stdin, self.proc.stdout):
      if pipe is not None:
        pipe.close()

  def __enter__(self) -> "TrainerProcess":
    return self

  def __exit__(self, exc_type: object, *exc: object) -> None:
    try:
      self.stop()
    except TrainerProcessError:
      if exc_type is None:
        raise  # otherwise the error already propagating is the one to report
