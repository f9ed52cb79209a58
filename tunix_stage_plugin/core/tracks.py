"""The timeline's track names, in one table: who records each, what a span on it is.

Recorders (core.pipeline, embedded.worker, embedded.server) and readers (bench.metrics,
bench.runner, bench.plot) use these constants, so a renamed track cannot silently empty a chart.
"""

from __future__ import annotations

import dataclasses

DEVICE_COMPUTE = "device/compute"
DEVICE_SYNC = "device/sync"
TRAINER_H2D = "trainer/h2d"
TRAINER_DECODE = "trainer/decode"
TRAINER_RECEIVE = "trainer/receive"
TRAINER_POOL_WAIT = "trainer/pool-wait"
ORCHESTRATOR_STAGE = "orchestrator/stage"
ORCHESTRATOR_TRAIN = "orchestrator/train"


@dataclasses.dataclass(frozen=True)
class Track:
  name: str
  description: str
  label: str | None = None  # its row in the timeline picture (bench.plot); None: not drawn


TRACKS = (
    Track(DEVICE_COMPUTE, "embedded trainer: one fwd_bwd (args step, kind, source) or update "
          "(args step, kind='update') on the compute lane", "device compute"),
    Track(DEVICE_SYNC, "embedded trainer: the step boundary's emulated weight sync (args step)",
          "weight sync"),
    Track(TRAINER_H2D, "embedded trainer: one micro-batch's placement plus emulated host-to-device "
          "time (args step, lane, bytes)", "host-to-device"),
    Track(TRAINER_DECODE, "embedded trainer: one compressed staged payload decoded on the staging "
          "lane, before its placement (args step, bytes, wire_bytes)", "decode (trainer)"),
    Track(TRAINER_RECEIVE, "embedded server: one large call's bytes arriving on the bulk channel, "
          "from its frame header to its last byte (name: the method; args bytes)",
          "wire in (trainer)"),
    Track(TRAINER_POOL_WAIT, "tunix bench node: one call's bytes waiting for the trainer's "
          "bounded receive pool (micro-batches still computing hold their buffers) before they "
          "are read (args bytes)", "receive pool wait"),
    Track(ORCHESTRATOR_STAGE, "core.pipeline: one engine.stage call, as the orchestrator saw it",
          "stage call"),
    Track(ORCHESTRATOR_TRAIN, "core.pipeline: one engine.train call (args staged)"),
)
BY_NAME = {t.name: t for t in TRACKS}
