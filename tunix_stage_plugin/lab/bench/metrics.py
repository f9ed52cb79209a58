"""The bench's figures from a run's spans: each step's time and device idle as the trainer's own
telemetry splits it (core.telemetry.recorder.TrainerSteps, over the trainer's device compute and
compute-lane spans: one clock, the trainer's), the compute per step, the host path, and whether
the job's own records agree. For step i:

- step seconds = end of step i's update - end of step i-1's update: one full cycle, including
  the boundary before the step (weight sync, then waiting for the first micro-batch);
- mid-step idle = the time between step i's first compute start and its update end that no
  compute span covers: the device waiting for the next micro-batch;
- boundary idle = step i's first compute start - step i-1's update end (this includes the
  emulated weight sync, which holds the trainer in every mode alike: the split's boundary wait
  and its other calls).

So step seconds = boundary idle + mid-step idle + busy compute. tests/bench/split_oracle.py
computes the same from the spans directly, and the tests hold the two together.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Iterable, Sequence

from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib


@dataclasses.dataclass(frozen=True)
class StepTiming:
  step: int
  seconds: float
  mid_step_idle: float
  boundary_idle: float
  compute: float


def _step_of(span: recorder_lib.Span) -> int:
  return dict(span.args)["step"]


# What a step's timing is made of: the computations and the compute lane's own calls.
SPLIT_TRACKS = (tracks.DEVICE_COMPUTE, tracks.DEVICE_SYNC, tracks.TRAINER_LANE)


def step_timings(spans: Iterable[recorder_lib.Span], steps: Iterable[int]) -> list[StepTiming]:
  """Timings of `steps` (each needs the step before it; steps count from the spans' first), as
  the trainer's own step split makes them from the spans, fed in the order they ended."""
  figures: list[dict] = []
  split = recorder_lib.TrainerSteps(figures.append)
  for span in sorted((s for s in spans if s.track in SPLIT_TRACKS), key=lambda s: s.end):
    split.record(span)
  by_step = {f["step"]: f for f in figures}
  out = []
  for step in steps:
    if step not in by_step or step - 1 not in by_step:
      raise ValueError(f"no device compute spans for step {step} or the step before it; "
                       f"recorded steps: {sorted(by_step)}")
    f = by_step[step]
    wait = f["input_wait_s"]
    out.append(StepTiming(step, f["step_s"], wait["mid_step"], wait["boundary"] + f["other_s"],
                          f["compute_s"]))
  return out


def fwd_bwd_durations(spans: Iterable[recorder_lib.Span], step: int) -> list[float]:
  """Device time of each of the step's fwd_bwd calls (longer under CPU contention)."""
  return [s.duration for s in spans if s.track == tracks.DEVICE_COMPUTE and _step_of(s) == step
          and dict(s.args).get("kind") == tracks.FWD_BWD]


def update_duration(spans: Iterable[recorder_lib.Span], step: int) -> float:
  """Device time of the step's update."""
  return max(s.duration for s in spans if s.track == tracks.DEVICE_COMPUTE and _step_of(s) == step
             and dict(s.args).get("kind") == tracks.UPDATE)


def calibrated(spans: Iterable[recorder_lib.Span], steps: Iterable[int]) -> tuple[float, float]:
  """A calibration's compute: the median fwd_bwd over `steps` and the median update."""
  spans = list(spans)
  compute = statistics.median(d for step in steps for d in fwd_bwd_durations(spans, step))
  update = statistics.median(s.duration for s in spans if s.track == tracks.DEVICE_COMPUTE
                             and dict(s.args).get("kind") == tracks.UPDATE)
  return compute, update


def compute_memory(rss: dict, held_bytes: int) -> int | None:
  """The compute's own working set: a process's peak above its baseline and the `held_bytes` of
  payloads it held meanwhile (None where /proc cannot tell)."""
  if rss["peak"] is None or rss["baseline"] is None:
    return None
  return max(0, rss["peak"] - rss["baseline"] - held_bytes)


def step_limit(microbatches: int, fwd_bwd_s: float, update_s: float, sync_s: float) -> float:
  """The shortest step the device allows: M fwd_bwd, the update and the weight sync, no waiting."""
  return microbatches * fwd_bwd_s + update_s + sync_s


def median(values: Sequence[float]) -> float | None:
  return statistics.median(values) if values else None


def hidden_fraction(t_inline: float | None, t_mode: float | None,
                    t_resident: float | None) -> float | None:
  """(T_inline - T_mode) / (T_inline - T_resident): 0 = nothing hidden, 1 = as if resident."""
  if t_inline is None or t_mode is None or t_resident is None or t_inline - t_resident <= 0:
    return None
  return (t_inline - t_mode) / (t_inline - t_resident)


# The two host paths a micro-batch can take: its receive (the method that carried it) and the
# lane its placement ran on.
HOST_PATHS = {"staged": ("stage_batch", "staging"), "inline": ("fwd_bwd", "inline")}


def host_path(spans: Iterable[recorder_lib.Span], since: float = float("-inf")
              ) -> dict[str, dict[str, float | int | None]]:
  """Per path: the median receive and placement seconds of one micro-batch, and its bytes over
  their sum (GiB/s), over the spans that end after `since` (the warm-up's end). Emulated links
  count: with near-zero ones this is the real host path."""
  spans = [s for s in spans if s.end >= since]
  out = {}
  for path, (method, lane) in HOST_PATHS.items():
    receives = [s for s in spans if s.track == tracks.TRAINER_RECEIVE and s.name == method]
    places = [s for s in spans if s.track == tracks.TRAINER_H2D and dict(s.args)["lane"] == lane]
    out[path] = path_figures(median([s.duration for s in receives]), places)
  return out


def path_figures(receive_s: float | None, places: Sequence[recorder_lib.Span]
                 ) -> dict[str, float | int | None]:
  """One host path's figures: its median receive (given) and placement (from its TRAINER_H2D
  spans) seconds of one micro-batch, and its bytes over their sum (GiB/s)."""
  place_s = median([s.duration for s in places])
  nbytes = median([dict(s.args)["bytes"] for s in places])
  rate = (nbytes / (receive_s + place_s) / (1 << 30)
          if receive_s is not None and place_s is not None and receive_s + place_s > 0 else None)
  return {"microbatches": len(places), "receive_s": receive_s, "place_s": place_s,
          "bytes": nbytes, "gib_per_s": rate}


def warmed_up(spans: Iterable[recorder_lib.Span], warmup_steps: int) -> float:
  """When the warm-up steps ended (their last update): the receive buffers are faulted by then."""
  return max(s.end for s in spans if s.track == tracks.DEVICE_COMPUTE
             and _step_of(s) == warmup_steps - 1)


def placement_overlap(spans: Iterable[recorder_lib.Span], since: float = float("-inf")
                      ) -> float | None:
  """The share of the staging lane's placement time (after `since`) during which the device
  computed: 1.0 = every staged copy overlapped compute; None when nothing was placed there."""
  spans = [s for s in spans if s.end >= since]
  compute = [s for s in spans if s.track == tracks.DEVICE_COMPUTE]
  placed = [s for s in spans if s.track == tracks.TRAINER_H2D and dict(s.args)["lane"] == "staging"]
  total = sum(s.duration for s in placed)
  if not placed or total <= 0:
    return None
  return sum(recorder_lib.busy_time(compute, s.start, s.end) for s in placed) / total


# The job-side figures agree with the bench's when within this share of the bench's, or AGREE_S.
AGREE_SHARE, AGREE_S = 0.10, 0.020


def job_side_agreement(timings: Sequence[StepTiming], records: Sequence[dict]
                       ) -> list[dict[str, float | int | bool]]:
  """Per timed step: the bench's mid-step and boundary idle (from its own device spans) beside
  the trainer's own record of the same step (core.telemetry: what a user's job writes), and
  whether they agree (within AGREE_SHARE of the bench's, or AGREE_S, whichever is larger). The
  record's boundary counts the compute lane's own calls (a weight sync) apart, as "other": here
  they are added back, as the bench's boundary idle holds them."""
  out = []
  for timing, record in zip(timings, records):
    wait = record["input_wait_s"]
    job_boundary = (wait["boundary"] or 0.0) + record["other_s"]
    pairs = ((timing.mid_step_idle, wait["mid_step"]), (timing.boundary_idle, job_boundary))
    out.append({"step": timing.step, "bench_mid_s": timing.mid_step_idle,
                "job_mid_s": wait["mid_step"], "bench_boundary_s": timing.boundary_idle,
                "job_boundary_s": job_boundary,
                "agrees": all(abs(job - bench) <= max(AGREE_SHARE * bench, AGREE_S)
                              for bench, job in pairs)})
  return out


def choices(orchestrator: Sequence[dict], trainer: Sequence[dict]) -> list[dict[str, Any]]:
  """An auto run's choices, each step's, from both processes' own records (what a job writes):
  the orchestrator's depth and the trainer's host bound in force, and why (None where that side
  was not sized)."""
  host = {rec["step"]: rec for rec in trainer}
  out = []
  for rec in orchestrator:
    bound = host.get(rec["step"], {})
    out.append({"step": rec["step"], "depth": rec["depth"], "depth_why": rec.get("sizing"),
                "host_bound": bound.get("settings", {}).get("max_host_batches"),
                "host_bound_why": bound.get("sizing")})
  return out
