"""Starting and stopping a trainer process (trainer_main) from the benchmark and the tests."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Mapping, Sequence

READY_PREFIX = "READY "


class TrainerProcessError(RuntimeError):
  """The trainer process did not come up, or did not exit cleanly."""


class TrainerProcess:
  """A trainer_main child bound to 127.0.0.1; `with` stops it (SIGTERM, then a bounded wait)."""

  def __init__(self, *, max_device_batches: int | None = None, mode: str = "stage",
               extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
               ready_timeout_s: float = 120.0) -> None:
    cmd = [sys.executable, "-m", "tunix_stage_plugin.embedded.trainer_main", "--port", "0",
           "--stage_train_batches", mode, *extra_args]
    if max_device_batches is not None:
      cmd += ["--max_device_batches", str(max_device_batches)]
    child_env = dict(os.environ if env is None else env)
    # The trainer's staging settings come from the flags above, not from this process's env.
    for name in ("TUNIX_STAGE_BATCH", "TUNIX_STAGE_MAX_DEVICE_BATCHES"):
      child_env.pop(name, None)
    self.cmd = cmd
    self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=child_env, text=True)
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

  def stop(self, timeout_s: float = 30.0) -> int:
    """SIGTERM and wait; returns the exit code (0 for a clean shutdown). Idempotent."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(timeout_s)
      except subprocess.TimeoutExpired:
        self.kill()
        raise TrainerProcessError(f"trainer {self.pid} ignored SIGTERM for {timeout_s:.0f} s; "
                                  "killed") from None
    if self.proc.stdout is not None:
      self.proc.stdout.close()
    return self.proc.returncode

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()
    if self.proc.stdout is not None:
      self.proc.stdout.close()

  def __enter__(self) -> "TrainerProcess":
    return self

  def __exit__(self, *exc: object) -> None:
    self.stop()
