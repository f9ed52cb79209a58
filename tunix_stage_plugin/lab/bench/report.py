"""The benchmark's figures: per-mode medians, the issue's criteria, the table and the JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.lab.bench import cpu
from tunix_stage_plugin.lab.bench import meta
from tunix_stage_plugin.lab.bench import metrics
from tunix_stage_plugin.lab.bench import results
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.reading import records as records_lib
from tunix_stage_plugin.reading import summary as summary_lib


@dataclasses.dataclass(frozen=True)
class HostChecks:
  """A host's timing targets (None: not judged there, only reported) and its inline memory."""

  hidden_min: float | None  # depth2_prestage hides at least this much of the inline host path
  limit_max: float  # and its step is at most this much above the device's limit
  ratio_min: float | None  # inline / depth2 median step time
  # Trainer memory (docs/bench.md, the checks): inline's peak at most its baseline + this many
  # payloads; a staged mode's at most inline's + (device bound + host bound) payloads +
  # STAGED_SLACK; both also allow RUNTIME_SLACK_BYTES for what the runtime allocates on its own
  # (XLA, gRPC, Python).
  inline_payloads: int


# The one table of checks per bench host (docs/bench.md "Hosts"). The embedded host's links are
# sized against the compute, so it must hide them; on tunix's host the host path is what tunix's
# links make it (often far under the compute), so only the step's distance from its limit is
# judged. Inline, the embedded trainer holds the payload arriving and the one computing; tunix's
# unary call holds the message, its unpickled arrays and their placement (unaligned, so copied)
# of the micro-batch arriving while the one computing still holds its own (tunix answers once
# XLA has the work queued): 5-6 payloads measured at 64 MiB.
CHECKS = {"embedded": HostChecks(hidden_min=0.97, limit_max=1.03, ratio_min=1.3,
                                 inline_payloads=2),
          "tunix": HostChecks(hidden_min=None, limit_max=1.15, ratio_min=None,
                              inline_payloads=6)}
TIMING, CORRECTNESS, MEMORY = "timing", "correctness", "memory"
# Inline within this share of resident: nothing much to hide, the report says so.
SMALL_GAP = 0.05
STAGED_SLACK = 0.10
RUNTIME_SLACK_BYTES = 64 << 20
GIB = 1 << 30


@dataclasses.dataclass
class ModeSummary:
  """Medians are over the quiet steps (other processes <= cpu.QUIET_CORES) when there are any."""

  mode: str
  step_s: list[float]  # every timed step of every run
  step_quiet: list[bool]  # aligned with step_s
  noisy: bool  # no quiet step: the medians are over noisy steps
  median_step_s: float
  mid_step_idle_s: float
  boundary_idle_s: float
  fwd_bwd_s: float  # median device time of one micro-batch's fwd_bwd
  update_s: float  # median device time of the update
  limit_s: float  # M x fwd_bwd_s + update_s + weight sync: the device never waiting
  stage_call_s: float | None  # median engine.stage call (wire + H2D + overhead)
  # median seconds of a stage call spent waiting for the trainer's bounded receive pool (None:
  # the host reports none)
  stage_wait_s: float | None
  hidden_fraction: float | None
  fallbacks: int
  peak_host_batches: int
  peak_device_batches: int
  max_device_batches: int
  trained_order: list[str]
  param_digest: str
  digests: list[str]  # one per run (round)
  orders_match: bool  # every run trained the expected order
  # Peak resident bytes above the run's baseline, the most of any run (None: not measured), and
  # the absolute peaks; the host path of the mode's micro-batches (metrics.host_path).
  trainer_growth: int | None = None
  trainer_peak: int | None = None
  orchestrator_peak: int | None = None
  host_path: dict | None = None
  h2d_s: float | None = None  # measured median placement seconds of one micro-batch
  h2d_overlap: float | None = None  # share of the staged placements' time the device computed
  device_memory: dict | None = None  # device bytes: baseline, sampled and allocator peaks

  @property
  def step_over_limit(self) -> float:
    return self.median_step_s / self.limit_s

  def to_json(self) -> dict[str, Any]:
    return {
        "step_s": self.step_s,
        "step_quiet": self.step_quiet,
        "median_step_s": self.median_step_s,
        "median_over": "noisy steps (no quiet one)" if self.noisy else "quiet steps",
        "idle_s": {"mid_step": self.mid_step_idle_s, "boundary": self.boundary_idle_s},
        "median_fwd_bwd_s": self.fwd_bwd_s,
        "median_update_s": self.update_s,
        "limit_s": self.limit_s,
        "step_over_limit": self.step_over_limit,
        "median_stage_call_s": self.stage_call_s,
        "median_stage_wait_s": self.stage_wait_s,
        "hidden_fraction": self.hidden_fraction,
        "fallbacks": self.fallbacks,
        "peak_device_batches": self.peak_device_batches,
        "max_device_batches": self.max_device_batches,
        "peak_host_batches": self.peak_host_batches,
        "trained_order": self.trained_order,
        "param_digest": self.param_digest,
        "param_digests_per_round": self.digests,
        "trained_order_as_expected_every_round": self.orders_match,
        "memory": {"trainer_peak_bytes": self.trainer_peak,
                   "trainer_peak_above_baseline_bytes": self.trainer_growth,
                   "orchestrator_peak_bytes": self.orchestrator_peak},
        "host_path": self.host_path,
        "median_h2d_s": self.h2d_s,
        "placement_overlapped_compute": self.h2d_overlap,
        "device_memory": self.device_memory,
    }


TINY_NA = "n/a (tiny)"  # --tiny's model is too small for its timings to mean anything


@dataclasses.dataclass(frozen=True)
class Criterion:
  name: str
  kind: str  # TIMING or CORRECTNESS
  passed: bool | None  # None: not measurable with the modes that ran, or not meaningful
  detail: str
  not_applicable: str = ""  # why the figure in `detail` is not judged (e.g. TINY_NA)
  value: float | None = None  # the figure judged, as a number (None: none was measured)
  threshold: float | None = None  # what it is compared with, by `comparison`
  comparison: str = ">="  # value >= threshold passes, or "<=": value <= threshold passes

  def to_json(self) -> dict[str, Any]:
    return {"name": self.name, "kind": self.kind, "passed": self.passed,
            "verdict": self.verdict, "value": self.value, "comparison": self.comparison,
            "threshold": self.threshold, "detail": self.detail}

  @property
  def verdict(self) -> str:
    if self.not_applicable:
      return self.not_applicable
    return {True: "PASS", False: "FAIL", None: "SKIP"}[self.passed]


def _timing(name: str, figure: float | None, minimum: float, needed: tuple[str, ...],
            summary: dict[str, ModeSummary], tiny: bool, shown: float | None = None
            ) -> Criterion:
  """PASS when figure >= minimum (a maximum is checked as -figure >= -maximum, `shown`)."""
  if shown is None:
    numbers = {"value": figure, "threshold": minimum}
  else:  # a maximum: the JSON holds the figure and the maximum themselves
    numbers = {"value": shown, "threshold": -minimum, "comparison": "<="}
  if any(m not in summary for m in needed):
    return Criterion(name, TIMING, None, f"needs {', '.join(needed)}",
                     **{**numbers, "value": None})
  text = ("-" if figure is None else f"{figure:.3f}") if shown is None else f"{shown:.3f}"
  if tiny:
    return Criterion(name, TIMING, None, text, not_applicable=TINY_NA, **numbers)
  if figure is None:
    return Criterion(name, TIMING, None, "inline was not slower than resident: nothing to hide",
                     **numbers)
  return Criterion(name, TIMING, figure >= minimum, text, **numbers)


def expected_order(result: results.BenchResult) -> list[str]:
  return data_lib.expected_order(result.options.total_steps, result.options.microbatches)


def summarize(result: results.BenchResult) -> dict[str, ModeSummary]:
  expected = expected_order(result)
  out = {}
  for mode in result.options.modes:
    runs = [r for r in result.runs if r.mode == mode]
    if not runs:  # an interrupted benchmark
      continue
    timings = [t for r in runs for t in r.timings]
    fwd_bwd = [d for r in runs for d in r.fwd_bwd_s]  # aligned with timings
    updates = [d for r in runs for d in r.update_s]
    quiet = [q for r in runs for q in r.step_quiet]
    used = [i for i, q in enumerate(quiet) if q] or list(range(len(timings)))
    out[mode] = ModeSummary(
        mode=mode, step_s=[t.seconds for t in timings], step_quiet=quiet, noisy=not any(quiet),
        median_step_s=metrics.median([timings[i].seconds for i in used]),
        mid_step_idle_s=metrics.median([timings[i].mid_step_idle for i in used]),
        boundary_idle_s=metrics.median([timings[i].boundary_idle for i in used]),
        fwd_bwd_s=metrics.median([d for i in used for d in fwd_bwd[i]]),
        update_s=metrics.median([updates[i] for i in used]),
        limit_s=metrics.step_limit(result.options.microbatches,
                                   metrics.median([d for i in used for d in fwd_bwd[i]]),
                                   metrics.median([updates[i] for i in used]),
                                   result.calibration.sync_s),
        stage_call_s=metrics.median([d for r in runs for d in r.stage_call_s]),
        stage_wait_s=metrics.median([d for r in runs for d in r.stage_wait_s]),
        hidden_fraction=None, fallbacks=sum(r.fallbacks for r in runs),
        peak_host_batches=max(r.peak_host_batches for r in runs),
        peak_device_batches=max(r.peak_device_batches for r in runs),
        max_device_batches=runs[-1].max_device_batches,
        trained_order=runs[-1].trained_order, param_digest=runs[-1].param_digest,
        digests=[r.param_digest for r in runs],
        orders_match=all(r.trained_order == expected for r in runs),
        trainer_growth=_most([_growth(r.trainer_rss) for r in runs]),
        trainer_peak=_most([r.trainer_rss.get("peak") for r in runs]),
        orchestrator_peak=_most([r.orchestrator_rss.get("peak") for r in runs]),
        host_path=_host_path(mode, runs),
        h2d_s=metrics.median([r.h2d_s for r in runs if r.h2d_s is not None]),
        h2d_overlap=metrics.median([r.h2d_overlap for r in runs if r.h2d_overlap is not None]),
        device_memory=_device_memory(runs))
  t_inline, t_resident = (out[m].median_step_s if m in out else None
                          for m in ("inline", "resident"))
  for summary in out.values():
    summary.hidden_fraction = metrics.hidden_fraction(t_inline, summary.median_step_s, t_resident)
  return out


def _growth(rss: dict) -> int | None:
  peak, baseline = rss.get("peak"), rss.get("baseline")
  return None if peak is None or baseline is None else peak - baseline


def _most(values: list[int | None]) -> int | None:
  known = [v for v in values if v is not None]
  return max(known) if known else None


def _device_memory(runs: list[results.ModeRun]) -> dict | None:
  """The trainer's device bytes over a mode's runs (None on a backend that keeps no figures)."""
  known = [r.device_memory for r in runs if r.device_memory.get("sampled_peak") is not None]
  if not known:
    return None
  return {"baseline_bytes": min(d["baseline"] for d in known),
          "sampled_peak_bytes": max(d["sampled_peak"] for d in known),
          "allocator_peak_bytes": _most([d["allocator_peak"] for d in known])}


def _host_path(mode: str, runs: list[results.ModeRun]) -> dict | None:
  """The mode's own path (staged or inline) over its runs: medians of the runs' medians."""
  path = "inline" if mode == "inline" else None if mode == "resident" else "staged"
  if path is None:
    return None
  per_run = [r.host_path[path] for r in runs if r.host_path and r.host_path[path]["microbatches"]]
  if not per_run:
    return None
  receive = metrics.median([p["receive_s"] for p in per_run if p["receive_s"] is not None])
  place = metrics.median([p["place_s"] for p in per_run if p["place_s"] is not None])
  rate = metrics.median([p["gib_per_s"] for p in per_run if p["gib_per_s"] is not None])
  return {"path": path, "receive_s": receive, "place_s": place, "gib_per_s": rate,
          "microbatches": sum(p["microbatches"] for p in per_run)}


def memory_criteria(result: results.BenchResult, summary: dict[str, ModeSummary]
                    ) -> list[Criterion]:
  """The trainer's peak memory against the documented bounds (docs/bench.md)."""
  o, c = result.options, result.calibration
  inline = summary.get("inline")
  payload = c.payload_bytes if c is not None else None
  growth = inline.trainer_growth if inline else None
  out = []
  inline_payloads = CHECKS[o.host].inline_payloads
  name = f"trainer memory: inline peak <= baseline + compute + {inline_payloads} x payload"
  if growth is None or payload is None:
    out.append(Criterion(name, MEMORY, None, "needs inline, measured on Linux"))
  else:
    working = c.compute_memory_bytes or 0
    bound = inline_payloads * payload + working + RUNTIME_SLACK_BYTES
    out.append(Criterion(name, MEMORY, growth <= bound,
                         f"{growth / GIB:.2f} GiB above baseline, bound {bound / GIB:.2f} GiB "
                         f"(with the compute's own {working / GIB:.2f} GiB, measured at "
                         "calibration)", value=growth, threshold=bound, comparison="<="))
  staged = {m: s for m, s in summary.items() if m not in ("inline", "resident")}
  # A run that sized its host bound (auto) held at most the most receive buffers it chose.
  bounds = o.max_device_batches + max([o.max_host_batches] + [
      c["host_bound"] for r in result.runs for c in r.choices if c["host_bound_why"]])
  name = (f"trainer memory: staged peak <= inline peak + (device + host bound = {bounds}) x "
          f"payload + {STAGED_SLACK:.0%}")
  measured = {m: s.trainer_growth for m, s in staged.items() if s.trainer_growth is not None}
  if growth is None or payload is None or not measured:
    out.append(Criterion(name, MEMORY, None, "needs inline and a staged mode, measured on Linux"))
  else:
    bound = (growth + bounds * payload) * (1 + STAGED_SLACK) + RUNTIME_SLACK_BYTES
    worst = max(measured.values())
    out.append(Criterion(name, MEMORY, worst <= bound, ", ".join(
        f"{m} {g / GIB:.2f}" for m, g in measured.items()) + f" GiB above baseline, bound "
        f"{bound / GIB:.2f} GiB", value=worst, threshold=bound, comparison="<="))
  return out


def criteria(result: results.BenchResult, summary: dict[str, ModeSummary]) -> list[Criterion]:
  out = []
  pre = summary.get("depth2_prestage")
  tiny = result.options.tiny
  targets = CHECKS[result.options.host]
  if targets.hidden_min is not None:
    out.append(_timing(f"depth2_prestage hidden fraction >= {targets.hidden_min}",
                       pre.hidden_fraction if pre else None, targets.hidden_min,
                       ("inline", "depth2_prestage", "resident"), summary, tiny))
  over_limit = pre.step_over_limit if pre else None
  out.append(_timing(f"depth2_prestage step <= {targets.limit_max} x limit",
                     None if over_limit is None else -over_limit, -targets.limit_max,
                     ("depth2_prestage",), summary, tiny, shown=over_limit))
  inline, depth2 = summary.get("inline"), summary.get("depth2")
  if targets.ratio_min is not None:
    ratio = inline.median_step_s / depth2.median_step_s if inline and depth2 else None
    out.append(_timing(f"inline / depth2 median step ratio >= {targets.ratio_min}", ratio,
                       targets.ratio_min, ("inline", "depth2"), summary, tiny))
  if result.options.scenario == "bursty":
    depth1 = summary.get("depth1")
    gain = depth1.median_step_s / depth2.median_step_s if depth1 and depth2 else None
    out.append(_timing("bursty: depth2 beats depth1 (depth1 / depth2 median step > 1)", gain,
                       1.0 + 1e-9, ("depth1", "depth2"), summary, tiny))
  digests = {d for s in summary.values() for d in s.digests}
  out.append(Criterion(
      "same param_digest in every mode and round", CORRECTNESS,
      None if not digests else len(digests) == 1,
      f"{len(digests)} distinct: " + ", ".join(sorted(d[:12] for d in digests)),
      value=len(digests) if digests else None, threshold=1, comparison="<="))
  wrong = [m for m, s in summary.items() if not s.orders_match]
  out.append(Criterion(
      "expected trained_order in every mode and round", CORRECTNESS,
      None if not summary else not wrong,
      f"{len(expected_order(result))} micro-batches, s0-m0 .. "
      f"{expected_order(result)[-1]}" + (f"; wrong in {wrong}" if wrong else ""),
      value=len(wrong) if summary else None, threshold=0, comparison="<="))
  staged = {m: s for m, s in summary.items() if m not in ("inline", "resident")}
  over = [m for m, s in staged.items() if s.peak_device_batches > s.max_device_batches]
  peaks = ", ".join(f"{m} {s.peak_device_batches}" for m, s in staged.items())
  out.append(Criterion(
      "peak staged device batches <= bound", CORRECTNESS,
      None if not staged else not over,
      f"bound {result.options.max_device_batches}; peaks: {peaks or 'no staged mode ran'}",
      value=max((s.peak_device_batches for s in staged.values()), default=None),
      threshold=min((s.max_device_batches for s in staged.values()), default=None),
      comparison="<="))
  out.append(job_side_criterion(result))
  return out + memory_criteria(result, summary)


def job_side_split(result: results.BenchResult) -> dict[str, dict[str, Any]]:
  """Per mode with trainer records: where its steps went by the trainer's own records (the
  reading layer's table and medians: summary.split), over the same steps as the table's medians
  (the quiet timed steps where there are any: `summarize`)."""
  out = {}
  for mode in dict.fromkeys(r.mode for r in result.runs):
    runs = [r for r in result.runs if r.mode == mode and r.job_side]
    records = [rec for r in runs for rec in r.job_side]
    quiet = [q for r in runs for q, _ in zip(r.step_quiet, r.job_side)]
    if not records:
      continue
    used = [i for i, q in enumerate(quiet) if q] or range(len(records))
    steps = records_lib.of_records([records[i] for i in used])[figures_lib.TRAINER]
    out[mode] = summary_lib.split(steps)
  return out


def job_side_criterion(result: results.BenchResult) -> Criterion:
  """The trainer's own per-step records (what a user's job writes) against the bench's own
  measurement of the same steps' idle: every step of every run that has them agrees."""
  compared = [(r.mode, a) for r in result.runs if r.job_side is not None
              for a in metrics.job_side_agreement(r.timings, r.job_side)]
  missing = sorted({r.mode for r in result.runs if r.job_side is None})
  off = [(mode, a) for mode, a in compared if not a["agrees"]]
  worst = ", ".join(f"{mode} s{a['step']}: mid {a['job_mid_s']:.3f} vs {a['bench_mid_s']:.3f} s, "
                    f"boundary {a['job_boundary_s']:.3f} vs {a['bench_boundary_s']:.3f} s"
                    for mode, a in off[:3])
  where = ("" if not missing else f"; no record where the trainer has no plugin: "
           f"{', '.join(missing)}")
  return Criterion(
      f"job-side input wait agrees with the bench's (within {metrics.AGREE_SHARE:.0%} or "
      f"{metrics.AGREE_S * 1000:.0f} ms per step)", CORRECTNESS,
      None if not compared else not off,
      f"{len(compared) - len(off)} of {len(compared)} steps agree" + (f"; {worst}" if off else "")
      + where, value=len(off) if compared else None, threshold=0, comparison="<=")


def _fmt(value: float | None, spec: str) -> str:
  return "-" if value is None else format(value, spec)


def wire_summary(result: results.BenchResult, mode: str) -> dict[str, Any]:
  """A mode's micro-batch bytes over all its runs: as sent per micro-batch, and the stage ratio
  (raw / sent; None when nothing was staged). The emulated wire paces the bytes sent."""
  runs = [r.wire for r in result.runs if r.mode == mode and r.wire]
  sent = sum(w["stage_sent_bytes"] + w["inline_bytes"] for w in runs)
  count = sum(w["stages"] + w["inline"] for w in runs)
  raw = sum(w["stage_raw_bytes"] for w in runs)
  staged = sum(w["stage_sent_bytes"] for w in runs)
  codec = result.options.codec_for(mode) if mode in result.options.modes else None
  return {"codec": str(codec) if codec else "off", "microbatches_sent": count,
          "wire_bytes_per_microbatch": sent / count if count else None,
          "stage_raw_bytes": raw, "stage_sent_bytes": staged,
          "stage_ratio": raw / staged if staged else None,
          "encode_s": sum(w["encode_s"] for w in runs)}


def format_table(result: results.BenchResult, summary: dict[str, ModeSummary]) -> str:
  header = ("mode", "step s", "mid-step idle s", "boundary idle s", "hidden", "limit",
            "fwd_bwd s", "fallbacks", "peak device batches", "wire MiB/mb", "ratio",
            "H2D s", "host GiB/s", "trainer GiB", "orch. GiB")
  rows = []
  for mode, s in summary.items():
    if mode == "resident":
      peak = "all resident"
    elif mode == "inline":
      peak = "0 (no staging)"
    else:
      peak = f"{s.peak_device_batches} of {s.max_device_batches}"
    hidden = _fmt(s.hidden_fraction, ".2f")
    if result.options.tiny and s.hidden_fraction is not None:
      hidden += " (n/a)"
    wire = wire_summary(result, mode)
    per_mb = wire["wire_bytes_per_microbatch"]
    rows.append((mode + (" *" if s.noisy else ""), _fmt(s.median_step_s, ".2f"),
                 _fmt(s.mid_step_idle_s, ".2f"),
                 _fmt(s.boundary_idle_s, ".2f"), hidden, _fmt(s.step_over_limit, ".3f"),
                 _fmt(s.fwd_bwd_s, ".3f"), str(s.fallbacks), peak,
                 _fmt(None if per_mb is None else per_mb / data_lib.MIB, ".2f"),
                 _fmt(wire["stage_ratio"], ".2f"), _fmt(s.h2d_s, ".3f"),
                 _fmt(s.host_path["gib_per_s"] if s.host_path else None, ".2f"),
                 _fmt(None if s.trainer_peak is None else s.trainer_peak / GIB, ".2f"),
                 _fmt(None if s.orchestrator_peak is None else s.orchestrator_peak / GIB, ".2f")))
  widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
  lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                     for i, (cell, w) in enumerate(zip(row, widths)))
           for row in (header, *rows)]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


# How far the modes' measured compute may be from the calibrated one before the report says the
# links were sized for another compute (calibration and modes under different outside load).
COMPUTE_MARGIN = 0.25


def compute_drift(result: results.BenchResult, summary: dict[str, ModeSummary]
                  ) -> dict[str, Any] | None:
  """The modes' median fwd_bwd against the calibrated compute the links were sized for."""
  c = result.calibration
  measured = [s.fwd_bwd_s for s in summary.values() if s.fwd_bwd_s is not None]
  if c is None or not measured:
    return None
  median = metrics.median(measured)
  ratio = median / c.compute_s
  return {"calibrated_s": c.compute_s, "measured_s": median, "ratio": ratio,
          "margin": COMPUTE_MARGIN, "sized_for_another_compute": abs(ratio - 1) > COMPUTE_MARGIN}


def choices_lines(result: results.BenchResult) -> list[str]:
  """What each auto run chose, step by step (the orchestrator's depth; the trainer's host bound
  where it was sized), and why its last step's were chosen (bench.json: runs[*].choices)."""
  out = []
  for run in (r for r in result.runs if r.choices):
    depths = " ".join(str(c["depth"]) for c in run.choices)
    last = run.choices[-1]
    sized = [c for c in run.choices if c["host_bound_why"]]
    bounds = (f", host bound {' '.join(str(c['host_bound']) for c in sized)}" if sized else "")
    why = "; ".join(w for w in (last["depth_why"], sized[-1]["host_bound_why"] if sized else None)
                    if w)
    out.append(f"{run.mode} round {run.round + 1} chose, step by step: depth {depths}{bounds}; "
               f"the last step: {why}")
  return out


def format_report(result: results.BenchResult, summary: dict[str, ModeSummary],
                  checks: list[Criterion]) -> str:
  o, c = result.options, result.calibration
  h2d = (f"H2D real on {c.platform} ({', '.join(c.devices)})" if c.h2d_s is None
         else f"H2D {c.h2d_s:.3f} s ({o.h2d_ratio:g} x, emulated)")
  if c.wire_s is None:
    links = (f"{o.host}'s own links on 127.0.0.1 (nothing emulated), {h2d}, "
             + (f"weight sync {c.sync_s:.3f} s" if c.sync_s else "no weight sync") + "; ")
  else:
    links = (f"wire {c.wire_s:.3f} s ({o.wire_ratio:g} x), {h2d}, "
             f"weight sync {c.sync_s:.3f} s ({o.sync_ratio:g} x); ")
  lines = [
      f"tunix-stage bench on the {o.host} host: {o.microbatches} micro-batches/step of "
      f"{c.payload_bytes / data_lib.MIB:.1f} MiB; per micro-batch compute {c.compute_s:.3f} s, "
      f"{links}device bound {o.max_device_batches}, "
      f"host bound {o.max_host_batches}"
      + (" (auto: sized in the auto mode)" if o.size_host_bound and "auto" in o.modes else "")
      + f"; scenario {o.scenario}",
      f"medians over {o.rounds} round(s) x {o.steps} timed step(s) per mode (each run after "
      f"{results.WARMUP_STEPS} warm-up step); "
      "hidden = (T_inline - T_mode) / (T_inline - T_resident); "
      "limit = step / (M x fwd_bwd + update + weight sync)",
      "",
      format_table(result, summary),
      "",
  ]
  lines += [f"{ch.verdict}  {ch.name}: {ch.detail}" for ch in checks]
  if c.noisy:
    lines.append(f"note: calibration stayed noisy: other processes used {c.foreign_cores:.2f} "
                 f"cores at the quietest of {c.tries} tries")
  drift = compute_drift(result, summary)
  if drift and drift["sized_for_another_compute"] and c.wire_s is None:
    lines.append(
        f"WARNING: the modes measured another compute than the calibration: calibrated "
        f"{c.compute_s:.3f} s per micro-batch, the modes measured {drift['measured_s']:.3f} s "
        f"({drift['ratio']:.2f} x, margin {COMPUTE_MARGIN:.0%}); rerun on a quiet machine")
  elif drift and drift["sized_for_another_compute"]:
    lines.append(
        f"WARNING: the links were sized for another compute: calibrated {c.compute_s:.3f} s per "
        f"micro-batch, the modes measured {drift['measured_s']:.3f} s ({drift['ratio']:.2f} x, "
        f"margin {COMPUTE_MARGIN:.0%}), so the wire and host-to-device times were not the "
        f"{o.wire_ratio:g} x and {o.h2d_ratio:g} x of compute asked for; rerun on a quiet machine")
  inline, resident = summary.get("inline"), summary.get("resident")
  if inline and resident and inline.median_step_s < (1 + SMALL_GAP) * resident.median_step_s:
    gap = inline.median_step_s / resident.median_step_s - 1
    lines.append(
        f"note: inline's step is within {gap:.1%} of resident's: the host path hardly shows in "
        "the step at this payload (its share of the compute: the host path line below), so the "
        "hidden fractions divide noise by noise")
  if o.tiny:
    lines.append(f"{TINY_NA}: --tiny's model is too small for its step times to mean anything, "
                 "so the timing checks and hidden fractions (even negative ones) judge nothing")
  pre = summary.get("depth2_prestage")
  if pre and pre.stage_call_s:
    copy = (f"{c.h2d_s:.3f} s" if c.h2d_s is not None
            else f"{_fmt(pre.h2d_s, '.3f')} s measured")
    held = pre.stage_wait_s or 0.0
    verdict = (f"Each is under the {c.compute_s:.3f} s of compute it hides behind, so the step "
               "can reach its limit" if pre.stage_call_s - held < c.compute_s else
               f"That is more than the {c.compute_s:.3f} s of compute it hides behind: the "
               "step is bound by the wire (a faster link or a codec, --stage_codec, helps)")
    wire = "" if c.wire_s is None else f"; the wire alone is {c.wire_s:.3f} s emulated"
    if held:
      wire += (f"; {held:.3f} s of it its bytes waited for the trainer's receive pool, whose "
               "bound counts the micro-batches still computing: memory held back, not path")
    lines.append(
        f"stage calls: {pre.stage_call_s:.3f} s each (median, measured{wire}), answered once "
        f"the trainer received the payload; its host-to-device copy ({copy}) then runs on the "
        f"trainer's staging lane while the next payload is on the wire. {verdict}; peak "
        f"received host buffers {pre.peak_host_batches} of {o.max_host_batches}")
  packed = summary.get("depth2_prestage_codec")
  if packed and packed.stage_call_s and c is not None:
    wire = wire_summary(result, "depth2_prestage_codec")
    ratio = _fmt(wire["stage_ratio"], ".2f")
    side = "under" if packed.stage_call_s < c.compute_s else "still over"
    lines.append(
        f"stage calls with the codec ({wire['codec']}, depth2_prestage_codec): "
        f"{packed.stage_call_s:.3f} s each (median), {side} the {c.compute_s:.3f} s of compute; "
        f"staged payloads {ratio}x smaller on the wire")
  paths = [(m, s.host_path) for m, s in summary.items() if s.host_path]
  if paths and c.memcpy_warm_bytes_per_s:
    lines.append(
        "host path (received + placed, per micro-batch"
        + (", emulated links included): " if c.wire_s is not None else "): ") + "; ".join(
            f"{m} {_fmt(p['gib_per_s'], '.2f')} GiB/s ({_fmt(p['receive_s'], '.3f')} s receive + "
            f"{_fmt(p['place_s'], '.3f')} s place{_of_compute(p, c)})" for m, p in paths)
        + f"; one memcpy of a micro-batch here: {c.memcpy_fresh_bytes_per_s / GIB:.2f} GiB/s "
        f"into fresh memory, {c.memcpy_warm_bytes_per_s / GIB:.2f} GiB/s warm")
  lines += choices_lines(result)
  split = job_side_split(result)
  if split:
    lines.append("where the trainer's step went, by its own records (medians per step): " + "; ".join(
        f"{m} compute {v['compute_s']:.3f} s, input wait {v['mid_step_s']:.3f} mid-step + "
        f"{v['boundary_s']:.3f} at the boundary, slowdown beside transfers "
        + ("n/a (no fwd_bwd ran alone)" if v["slowdown_s"] is None else
           f"{v['slowdown_s']:.3f} s (alone {v['alone_s']:.3f} s per fwd_bwd; known in "
           f"{v['steps_with_slowdown']} of {v['steps']} steps)")
        + f", bound by {v['bound_by']}" for m, v in split.items()))
  overlaps = [(m, s.h2d_overlap) for m, s in summary.items() if s.h2d_overlap is not None]
  if overlaps:
    lines.append("staged placements overlapped compute for " + ", ".join(
        f"{m} {v:.0%}" for m, v in overlaps) + " of their time (H2D s: measured median per "
        "micro-batch, emulated time included)")
  devices = [(m, s.device_memory) for m, s in summary.items() if s.device_memory]
  bound = (o.max_device_batches + 1) * c.payload_bytes
  if devices:
    lines.append("device memory above the setup's, most after a placement: " + ", ".join(
        f"{m} {(d['sampled_peak_bytes'] - d['baseline_bytes']) / GIB:.2f} GiB" for m, d in devices)
        + f" (the device bound + the batch computing: {bound / GIB:.2f} GiB)")
  else:
    lines.append(f"device memory: n/a (the {c.platform} backend keeps no allocator figures)")
  dropped = sum(not q for s in summary.values() for q in s.step_quiet)
  if dropped:
    lines.append(f"note: {dropped} step(s) ran while other processes used more than "
                 f"{cpu.QUIET_CORES} cores; medians leave them out")
  noisy = [m for m, s in summary.items() if s.noisy]
  if noisy:
    lines.append(f"WARNING: * no quiet step at all for {', '.join(noisy)}: its figures are noise "
                 "from other processes; rerun on a quiet machine")
  return "\n".join(lines)


def _of_compute(path: dict[str, Any], c: results.Calibration) -> str:
  """A micro-batch's host path as a share of its compute (what staging can hide behind it)."""
  if path["receive_s"] is None or path["place_s"] is None:
    return ""
  return f" = {(path['receive_s'] + path['place_s']) / c.compute_s:.2f} x compute"


def _h2d_s(c: results.Calibration, summary: dict[str, ModeSummary]) -> float | None:
  """One micro-batch's host-to-device seconds: the emulated time, or with real copies the median
  measured in the inline mode (what `tunix-stage simulate` reads from a bench JSON)."""
  if c.h2d_s is not None:
    return c.h2d_s
  inline = summary.get("inline")
  return inline.h2d_s if inline else None


def _wire_s(c: results.Calibration, summary: dict[str, ModeSummary]) -> float | None:
  """One micro-batch's wire seconds: the emulated time, or over a host's real links the median
  measured receive of the staged path (else the inline one): what `simulate` reads."""
  if c.wire_s is not None:
    return c.wire_s
  paths = [s.host_path for s in summary.values() if s.host_path]
  for path in ("staged", "inline"):
    found = [p["receive_s"] for p in paths if p["path"] == path and p["receive_s"] is not None]
    if found:
      return metrics.median(found)
  return None


def to_json(result: results.BenchResult, summary: dict[str, ModeSummary],
            checks: list[Criterion], files: dict[str, str]) -> dict[str, Any]:
  c = result.calibration
  return {
      "meta": meta.run_meta(result.options),
      "interrupted": result.interrupted is not None,
      "interrupted_by": result.interrupted,
      "options": {**dataclasses.asdict(result.options), "modes": list(result.options.modes),
                  "warmup_steps": results.WARMUP_STEPS, "sizes": result.options.sizes().as_dict()},
      "calibration": None if c is None else {**dataclasses.asdict(c), "wire_s": _wire_s(c, summary),
                                             "h2d_s": _h2d_s(c, summary)},
      "compute_vs_calibration": compute_drift(result, summary),
      "expected_trained_order": expected_order(result),
      "modes": {m: s.to_json() for m, s in summary.items()},
      "wire": {m: wire_summary(result, m) for m in summary},
      "criteria": [ch.to_json() for ch in checks],
      "job_side_split": job_side_split(result),
      "runs": [{"mode": r.mode, "round": r.round, "step_s": [t.seconds for t in r.timings],
                "mid_step_idle_s": [t.mid_step_idle for t in r.timings],
                "boundary_idle_s": [t.boundary_idle for t in r.timings],
                "fwd_bwd_s": r.fwd_bwd_s, "update_s": r.update_s,
                "fallbacks": r.fallbacks, "fallback_reasons": r.fallback_reasons,
                "h2d_s": r.h2d_s, "placement_overlapped_compute": r.h2d_overlap,
                "device_memory": r.device_memory,
                "other_processes_cores": r.step_foreign_cores, "step_quiet": r.step_quiet,
                "wire": r.wire,
                "job_side": None if r.job_side is None else metrics.job_side_agreement(
                    r.timings, r.job_side), "choices": r.choices,
                "job_side_steps": None if r.job_side is None else [
                    {"step": rec["step"], "compute_s": rec["compute_s"],
                     "input_wait_s": rec["input_wait_s"], "bound_by": rec["bound_by"],
                     **{k: rec["compute"][k] for k in ("alone_s", "beside_transfer",
                                                       "slowdown_s")}}
                    for rec in r.job_side]}
               for r in result.runs],
      "wall_s": result.wall_s,
      "trainer_exit_code": result.trainer_exit_code,
      "files": files,
  }
