"""What one bench run is asked and what it finds: the options, the calibration, each mode run.

Host-agnostic: the runner, report, checks, trace and `simulate` read these, and each bench host
(host.py) fills them in (docs/bench.md "What runs").
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from tunix_stage_plugin.core import codec_spec
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.lab.bench import cpu
from tunix_stage_plugin.lab.bench import metrics
from tunix_stage_plugin.lab.bench import modes as modes_lib
from tunix_stage_plugin.lab.embedded import data as data_lib

if TYPE_CHECKING:  # the codec loads where a mode compresses
  from tunix_stage_plugin.core import codec as codec_lib

WARMUP_STEPS = 1
# A calibration's resident steps: the first compiles; the medians and the compute's memory use
# the others.
CALIBRATION_STEPS = 3


def mode_codec(stage_codec: str, mode: str) -> codec_lib.Codec | None:
  """The codec of a mode's stages: --stage_codec, or `on` for a codec mode when that is off.
  Raises codec.CodecUnavailable when its library is not installed."""
  if modes_lib.BY_NAME[mode].codec and stage_codec == codec_spec.OFF:
    stage_codec = codec_spec.ON
  if stage_codec.strip() == codec_spec.OFF:
    return None
  from tunix_stage_plugin.core import codec as codec_lib  # pylint: disable=import-outside-toplevel
  return codec_lib.parse(stage_codec)


@dataclasses.dataclass(frozen=True)
class BenchOptions:
  """One bench run's options, as `tunix-stage bench` checked them (lab/bench/command.py: every
  option is checked there, once, before anything starts)."""

  host: str = "embedded"  # host.HOSTS
  rounds: int = 3
  steps: int = 2  # timed steps per mode run, after WARMUP_STEPS
  microbatches: int = 4
  payload_mib: float = 16.0
  wire_ratio: float = 0.8
  h2d_ratio: float = 0.4
  sync_ratio: float = 0.5
  max_device_batches: int = 1
  max_host_batches: int = 1  # the fixed modes' host bound
  # The auto mode sizes the trainer's host bound too (TUNIX_STAGE_MAX_HOST_BATCHES=auto, the
  # default), from max_host_batches; False: it runs at max_host_batches, as the fixed modes do.
  size_host_bound: bool = False
  scenario: str = "steady"
  modes: tuple[str, ...] = modes_lib.DEFAULT_MODES
  seed: int = 0
  tiny: bool = False
  retries: int = 3  # re-runs of mode runs with no quiet step, for the whole benchmark
  payload: str = "dense"  # data.PAYLOADS
  codec: str = "off"  # TUNIX_STAGE_CODEC's values: staged payloads compressed (core.codec)
  h2d: str = "auto"  # modes.H2D
  log_every: int = 1  # the job's per-step lines (TUNIX_STAGE_LOG_EVERY; 0: none, as --quiet)
  # The auto mode's budget (TUNIX_STAGE_MEMORY_BUDGET; default a quarter of the machine's memory).
  memory_budget: int = config_lib.SETTINGS_BY_FIELD["memory_budget"].default

  def codec_for(self, mode: str) -> codec_lib.Codec | None:
    return mode_codec(self.codec, mode)

  @property
  def total_steps(self) -> int:
    return WARMUP_STEPS + self.steps

  def sizes(self) -> data_lib.Sizes:
    base = data_lib.TINY_SIZES if self.tiny else data_lib.DEFAULT_SIZES
    return base.with_payload(self.payload).with_payload_mib(self.payload_mib)


@dataclasses.dataclass(frozen=True)
class Calibration:
  compute_s: float  # median fwd_bwd of one micro-batch on the device
  update_s: float
  payload_bytes: int
  wire_bytes_per_s: float | None  # None: the host's real links (nothing emulated)
  h2d_bytes_per_s: float | None  # None: --h2d real, the trainer's own copies (measured per run)
  sync_s: float
  clock_offset_s: float  # trainer perf_counter + offset = orchestrator perf_counter
  clock_uncertainty_s: float
  # One payload-sized copy on this machine, in this run: into fresh memory (its page faults
  # included) and into the same memory again (warm): the host path's physical limit.
  memcpy_fresh_bytes_per_s: float | None = None
  memcpy_warm_bytes_per_s: float | None = None
  # The trainer's compute working set (activations, XLA's buffers): its peak during the resident
  # calibration steps above its baseline and the resident payloads (None where not measured).
  compute_memory_bytes: int | None = None
  h2d: str = "emulated"  # what --h2d resolved to: real or emulated
  platform: str = "cpu"  # the trainer's JAX backend
  devices: tuple[str, ...] = ()  # the trainer's devices, as JAX names them
  # Other processes' cores while the compute was measured (None: unknown), how many tries the
  # calibration took, and whether even the quietest one was busier than cpu.QUIET_CORES.
  foreign_cores: float | None = None
  tries: int = 1
  noisy: bool = False

  @property
  def wire_s(self) -> float | None:
    """The emulated wire time of one micro-batch (None when the links are real)."""
    return None if self.wire_bytes_per_s is None else self.payload_bytes / self.wire_bytes_per_s

  @property
  def h2d_s(self) -> float | None:
    """The emulated host-to-device time of one micro-batch (None when the copies are real)."""
    return None if self.h2d_bytes_per_s is None else self.payload_bytes / self.h2d_bytes_per_s


@dataclasses.dataclass
class ModeRun:
  mode: str
  round: int
  timings: list[metrics.StepTiming]
  fwd_bwd_s: list[list[float]]  # per timed step, each micro-batch's device time (contention)
  update_s: list[float]  # per timed step, the update's device time
  stage_call_s: list[float]  # every engine.stage call of the run, orchestrator side
  fallbacks: int
  fallback_reasons: list[str]
  peak_device_batches: int
  peak_host_batches: int
  max_device_batches: int
  trained_order: list[str]
  param_digest: str
  step_foreign_cores: list[float | None]  # other processes' CPU during each timed step
  spans: list[recorder_lib.Span]  # orchestrator and trainer spans, on the orchestrator's clock
  origin: float  # orchestrator time the run started
  # engine.WireStats.as_dict() of the run: micro-batch bytes as arrays and as sent (all steps)
  wire: dict = dataclasses.field(default_factory=dict)
  # Each process's resident bytes when the run started and its peak during the run (None where
  # /proc cannot tell), and metrics.host_path of the trainer's spans.
  trainer_rss: dict = dataclasses.field(default_factory=dict)
  orchestrator_rss: dict = dataclasses.field(default_factory=dict)
  host_path: dict = dataclasses.field(default_factory=dict)
  # The trainer's device memory (worker.finish: baseline, sampled_peak, allocator_peak; None each
  # on CPU), its placements' median seconds after the warm-up, and the share of the staging
  # lane's placement time that ran while the device computed.
  device_memory: dict = dataclasses.field(default_factory=dict)
  h2d_s: float | None = None
  h2d_overlap: float | None = None
  # Aligned with stage_call_s where the host has one: the seconds of each stage call its bytes
  # waited for the trainer's bounded receive pool (tunix's host; empty on the embedded one).
  stage_wait_s: list[float] = dataclasses.field(default_factory=list)
  # The trainer's own per-step records (core.telemetry, what a user's job writes) of the timed
  # steps: checked against `timings` (metrics.job_side_agreement). None: the trainer of this run
  # has no plugin (tunix's own node).
  job_side: list[dict] | None = None
  # An auto run's choices, each step's (the warm-up's too): the orchestrator's depth and the
  # trainer's host bound in force and why ({"step", "depth", "depth_why", "host_bound",
  # "host_bound_why"}; a why None where that side was not sized); [] for a fixed mode.
  choices: list[dict] = dataclasses.field(default_factory=list)

  @property
  def step_quiet(self) -> list[bool]:
    return [f is None or f <= cpu.QUIET_CORES for f in self.step_foreign_cores]


@dataclasses.dataclass
class BenchResult:
  """Filled in as the benchmark goes, so an interrupted one still has the runs that finished."""

  options: BenchOptions
  calibration: Calibration | None = None  # None: interrupted before calibrating
  runs: list[ModeRun] = dataclasses.field(default_factory=list)
  wall_s: float = 0.0
  trainer_exit_code: int | None = None
  interrupted: str | None = None  # the signal's name when a signal stopped the benchmark early


def runs_of_round(result: BenchResult, round_: int | None = None) -> dict[str, ModeRun]:
  """The runs of one round (the last by default), by mode, in the options' mode order."""
  round_ = result.options.rounds - 1 if round_ is None else round_
  runs = {r.mode: r for r in result.runs if r.round == round_}
  return {m: runs[m] for m in result.options.modes if m in runs}
