"""This process's resident memory and its peak, with the peak reset between jobs (Linux).

The bench reports each process's peak per mode (docs/bench.md "How to read the figures"), so the
peak must start again at each mode: writing 5 to /proc/self/clear_refs resets VmHWM to the current
VmRSS (Linux >= 4.0). Elsewhere every reading is None.
"""

from __future__ import annotations


def status_bytes(field: str, pid: int | str = "self") -> int | None:
  """A process's memory field from /proc/PID/status (VmRSS, VmHWM, ...) in bytes; None where
  there is none (not Linux, no such process or field)."""
  try:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
      for line in f:
        if line.startswith(f"{field}:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def current() -> int | None:
  """Resident bytes now (VmRSS)."""
  return status_bytes("VmRSS")


def peak() -> int | None:
  """The most resident bytes since start, or since the last reset (VmHWM)."""
  return status_bytes("VmHWM")


def reset_peak() -> int | None:
  """Starts the peak again from the current resident bytes; returns them (None: not here)."""
  try:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
      f.write("5")
  except OSError:
    return None
  return current()


def report(reset: bool = False, top: int = 5) -> dict[str, object]:
  """Memory facts of this process: resident now and at peak, and, when tracemalloc is tracing
  (PYTHONTRACEMALLOC=1), Python's traced bytes and largest allocation sites. `reset` starts both
  peaks again afterwards (tools/profile_host_path.py)."""
  import tracemalloc  # pylint: disable=import-outside-toplevel  (only when asked)
  out: dict[str, object] = {"rss": current(), "peak": peak(), "traced": None, "top": []}
  if tracemalloc.is_tracing():
    traced, traced_peak = tracemalloc.get_traced_memory()
    out["traced"] = {"current": traced, "peak": traced_peak}
    stats = tracemalloc.take_snapshot().statistics("lineno")[:top]
    out["top"] = [(str(s.traceback[0]), s.size, s.count) for s in stats]
    if reset:
      tracemalloc.reset_peak()
  if reset:
    reset_peak()
  return out
