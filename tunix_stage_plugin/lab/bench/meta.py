"""What makes two benchmark JSONs comparable: versions, commit, machine, date and options.

`run_meta` never fails: a figure it cannot get (no git, not a checkout, a package not installed)
is None.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from typing import Any

import tunix_stage_plugin

PACKAGES = ("jax", "jaxlib", "grpcio", "numpy")


def _git(directory: str, *args: str) -> str | None:
  """git's stdout in `directory`, None when git is missing, fails or takes over 10 s."""
  try:
    done = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True,
                          timeout=10, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return done.stdout if done.returncode == 0 else None


def _package_dir() -> str:
  return os.path.dirname(os.path.abspath(tunix_stage_plugin.__file__))


def git_commit(directory: str | None = None) -> str | None:
  """HEAD's commit of the checkout holding the package (None when the package is not tracked
  in one: an installed wheel, or a folder inside some other repository)."""
  directory = directory or _package_dir()
  if _git(directory, "ls-files", "--error-unmatch", "__init__.py") is None:
    return None
  commit = (_git(directory, "rev-parse", "HEAD") or "").strip()
  return commit if len(commit) >= 40 else None


def git_dirty(directory: str | None = None) -> bool | None:
  """Whether that checkout has changes to tracked files (None: no checkout)."""
  out = _git(directory or _package_dir(), "status", "--porcelain", "--untracked-files=no")
  return None if out is None else bool(out.strip())


def version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return None


def run_meta(options: Any) -> dict[str, Any]:
  """The run's context; `options` a BenchOptions (a dataclass), recorded whole."""
  commit = git_commit()
  try:
    hostname = socket.gethostname()
  except OSError:
    hostname = None
  return {
      "plugin_version": tunix_stage_plugin.__version__,
      "git_commit": commit,
      "git_dirty": git_dirty() if commit else None,
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "hostname": hostname,
      "cpu_count": os.cpu_count(),
      "platform": platform.platform(),
      "python": platform.python_version(),
      "python_executable": sys.executable,
      **{package: version(package) for package in PACKAGES},
      "options": {**dataclasses.asdict(options), "modes": list(options.modes)},
  }


def run_date(path: str) -> str:
  """When the bench JSON at `path` was made: its meta.date_utc, else the file's time (UTC)."""
  try:
    with open(path, encoding="utf-8") as f:
      date = json.load(f).get("meta", {}).get("date_utc")
    if isinstance(date, str) and date:
      return date
  except (OSError, ValueError, AttributeError):
    pass
  try:
    mtime = os.path.getmtime(path)
  except OSError:
    return "an unknown date"
  return datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).isoformat(
      timespec="seconds")
