"""Fixtures several test folders share."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest


def _share_jax_compilations() -> None:
  """One JAX persistent compilation cache for the session, inherited by every process the tests
  start through the environment: those trainer processes compile the same few programs, and each
  one after the first loads them instead of compiling them again (4-6 s of a tiny trainer's
  first step on 2 cores). The cache holds XLA's output for a program, keyed by the program, the
  JAX version, the backend and the flags: a process gets the executable it would have compiled,
  so what the tests check (staging, order, parameters, the calls and their records) is the same.
  A fresh folder per session, removed at exit; a caller's own JAX_COMPILATION_CACHE_DIR (.ci/run
  gives its parts one, fresh per run) is used instead. Every program is kept, however quick its
  compile, and reads and writes take the cache's file lock where `filelock` is importable (JAX
  needs it for that), so a process never reads an entry another is writing. Set before anything
  here imports JAX, which reads these once."""
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    folder = tempfile.mkdtemp(prefix="tunix-stage-tests-jax-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  if importlib.util.find_spec("filelock") is not None:
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 << 30))


_share_jax_compilations()


@pytest.fixture(name="tiny_run", scope="session")
def fixture_tiny_run(tmp_path_factory):
  """One real tiny quick bench run for the session (tests/bench reads its report, files and
  progress lines; tests/sim checks and replays it): (the finished process, its output folder).
  Its files are read, never written."""
  out = tmp_path_factory.mktemp("tiny") / "out"
  cmd = [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--tiny", "--quick",
         "--steps", "1", "--microbatches", "3", "--payload_mib", "0.05", "--out", str(out)]
  return subprocess.run(cmd, capture_output=True, text=True, timeout=240), out
