"""The spans' track names, in one table: what a span on each is and who records it.

Recorders (the hosts' staging paths through core.telemetry, the embedded host's trainer) and
readers (the step aggregators of core.telemetry, the bench's figures and picture) use these
constants, so a renamed track cannot silently empty a record or a chart. docs/observability.md.
"""

from __future__ import annotations

import dataclasses

DEVICE_COMPUTE = "device/compute"
DEVICE_SYNC = "device/sync"
TRAINER_LANE = "trainer/lane"
TRAINER_H2D = "trainer/h2d"
TRAINER_DECODE = "trainer/decode"
TRAINER_RECEIVE = "trainer/receive"
TRAINER_POOL_WAIT = "trainer/pool-wait"
TRAINER_FALLBACK = "trainer/fallback"
ORCHESTRATOR_STAGE = "orchestrator/stage"
ORCHESTRATOR_TRAIN = "orchestrator/train"
ORCHESTRATOR_SEND = "orchestrator/send"

# A DEVICE_COMPUTE span's kind (its args' `kind`): a micro-batch's computation, and the one that
# ends a step (its optimizer update). The hosts' trainers name their calls so too.
FWD_BWD, UPDATE = "fwd_bwd", "update"


@dataclasses.dataclass(frozen=True)
class Track:
  name: str
  description: str
  label: str | None = None  # its row in the bench's timeline picture; None: not drawn


TRACKS = (
    Track(DEVICE_COMPUTE, "trainer: one computation on the device, fwd_bwd or update (args kind, "
          "step, source: staged, inline or resident), from when it could start (queued, or the "
          "computation before it ended) to when its output was ready", "device compute"),
    Track(DEVICE_SYNC, "trainer: a step boundary's weight sync (the embedded host emulates one; "
          "args step)", "weight sync"),
    Track(TRAINER_LANE, "trainer: one call on the compute lane that is not a computation of its "
          "own (weight sync, checkpoint, ...: args method); it holds the device between steps"),
    Track(TRAINER_H2D, "trainer: one micro-batch's placement (its preparation and host-to-device "
          "copy; args lane: staging or inline, bytes)", "host-to-device"),
    Track(TRAINER_DECODE, "trainer: one compressed staged payload decoded on the staging lane, "
          "before its placement (args bytes, wire_bytes)", "decode (trainer)"),
    Track(TRAINER_RECEIVE, "trainer: one call's micro-batch bytes arriving, from its first byte "
          "(or its header) to its last (name: the method; args transport, bytes)",
          "wire in (trainer)"),
    Track(TRAINER_POOL_WAIT, "trainer: one call's bytes waiting for the bounded receive pool "
          "(micro-batches still computing hold their buffers) before they are read (args bytes, "
          "over: the wait ran out)", "receive pool wait"),
    Track(TRAINER_FALLBACK, "trainer: a micro-batch received for staging that could not be "
          "placed, trained from its payload by its train call (args reason)"),
    Track(ORCHESTRATOR_STAGE, "orchestrator: one stage call as the pipeline saw it (args step, "
          "index, status)", "stage call"),
    Track(ORCHESTRATOR_TRAIN, "orchestrator: one train call (args step, index, staged)"),
    Track(ORCHESTRATOR_SEND, "orchestrator: one call carrying a micro-batch, sent by one "
          "transport (name: the method; args transport: side, stream or unary, bytes, step)"),
)
BY_NAME = {t.name: t for t in TRACKS}
