"""Processes as /proc shows them, for the tests that check nothing is left running."""

from __future__ import annotations

import os


def running(pid: int) -> bool:
  """True while /proc shows the pid and it is neither a zombie nor dead."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
  except (OSError, IndexError):
    return False


def children(pid: int, marker: bytes) -> list[int]:
  """The processes whose parent is `pid` and whose command line holds `marker`."""
  found = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat", encoding="ascii") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmdline = f.read()
    except (OSError, ValueError, IndexError):
      continue
    if ppid == pid and marker in cmdline:
      found.append(int(entry))
  return found
