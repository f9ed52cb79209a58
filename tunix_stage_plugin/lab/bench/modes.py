"""The benchmark's vocabularies, one table each: its modes, hosts, transfer scenarios and
host-to-device copies (light: the CLI builds --help from them without loading the benchmark)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mode:
  """One benchmark mode: its name, how the job runs it, and what it means (for --help)."""

  name: str
  plan: dict
  help: str
  codec: bool = False  # its stages compress (--stage_codec, or `on` when that is off)
  default: bool = True  # run without --modes (the codec and auto modes only when named)


# The one table of benchmark modes: runner, --help and report read it (docs/bench.md shows it).
MODE_TABLE = (
    Mode("inline", dict(kind="inline"),
         "every micro-batch travels with its train call; nothing staged"),
    Mode("depth1", dict(kind="staged", depth=1),
         "up to 1 micro-batch staged ahead of the pending train call"),
    Mode("depth2", dict(kind="staged", depth=2),
         "up to 2 micro-batches staged ahead of the pending train call"),
    Mode("depth2_prestage", dict(kind="staged", depth=2, prestage=True),
         "depth2, and the next step's first micro-batches stage across the step boundary "
         "(update + weight sync)"),
    Mode("resident", dict(kind="resident"),
         "all micro-batches on the device before the first step: the ceiling"),
    Mode("depth2_prestage_codec", dict(kind="staged", depth=2, prestage=True),
         "depth2_prestage with staged payloads compressed (by --stage_codec, or on = "
         "blosc2-zstd:1 when that is off), so one run compares both; needs the codec extra; "
         "not run unless named in --modes", codec=True, default=False),
    Mode("auto", dict(kind="staged", depth=2, prestage=True, auto=True),
         "the depth sized each step from the job's measured waits within "
         "TUNIX_STAGE_MEMORY_BUDGET (TUNIX_MAX_STAGED_BATCHES=auto), prestaging as "
         "depth2_prestage does; not run unless named in --modes", default=False),
)
MODES = tuple(m.name for m in MODE_TABLE)
BY_NAME = {m.name: m for m in MODE_TABLE}
# What runs without --modes (and what simulate models: it has no codec): the uncompressed fixed
# modes.
DEFAULT_MODES = tuple(m.name for m in MODE_TABLE if m.default)

# How each micro-batch's wire transfer behaves (lab/embedded/bench.transfer_slowdown).
SCENARIOS = {
    "steady": "every transfer at the calibrated wire speed",
    "bursty": "seeded: the first third of each step's transfers 1.6x slower, and a fifth of all "
              "2x slower (the front-loaded contention the upstream change measured)",
}


@dataclasses.dataclass(frozen=True)
class Host:
  """One host the bench can drive: its name (--host), the module holding its BenchHost, help."""

  name: str
  module: str
  help: str


# The one table of bench hosts (host.load reads it; --help lists it).
HOSTS = (
    Host("embedded", "tunix_stage_plugin.lab.embedded.bench",
         "the plugin's own gRPC host: one trainer process, emulated links calibrated to "
         "production's proportions (any machine)"),
    Host("tunix", "tunix_stage_plugin.lab.tunix.bench",
         "tunix's own GrpcRemoteExecutionServer, TrainerWorker and PeftTrainer in trainer node "
         "processes, driven by tunix's DistributedRLEngine and StandardRLProgram; tunix's real "
         "links on 127.0.0.1 (needs tunix's experimental stack, docs/tunix.md)"),
)
HOST_NAMES = tuple(h.name for h in HOSTS)
HOST_BY_NAME = {h.name: h for h in HOSTS}

# How a micro-batch's host-to-device copy is done (--h2d).
H2D = {
    "auto": "real on a machine whose JAX backend is an accelerator, emulated on CPU (the default)",
    "real": "the trainer's own jax.device_put onto its devices, measured; nothing emulated",
    "emulated": "on CPU devices, the real device_put (zero-copy for an aligned buffer) plus a "
                "sleep of --h2d_ratio x compute on one shared link",
}


def epilog() -> str:
  """The modes and scenarios as `tunix-stage bench --help` lists them."""
  width = max(len(m.name) for m in MODE_TABLE) + 2
  lines = ["modes:"] + [f"  {m.name:<{width}}{m.help}" for m in MODE_TABLE]
  lines += ["", "hosts (--host):"] + [f"  {h.name:<{width}}{h.help}" for h in HOSTS]
  lines += ["", "scenarios (--scenario):"] + [f"  {k:<{width}}{v}" for k, v in SCENARIOS.items()]
  lines += ["", "host-to-device copies (--h2d):"] + [f"  {k:<{width}}{v}" for k, v in H2D.items()]
  lines += ["", "hidden fraction = (T_inline - T_mode) / (T_inline - T_resident)",
            "limit = step / (M x fwd_bwd + update + weight sync), all measured: 1.00 is the "
            "device never waiting"]
  return "\n".join(lines)
