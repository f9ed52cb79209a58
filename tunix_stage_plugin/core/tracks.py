"""The spans' track names, in one table: what a span on each is and who records it.

Recorders and readers (the step figures, the bench's figures and picture) use these constants, so
a renamed track cannot silently empty a record or a chart. docs/observability.md.
"""

# The trainer's. A computation on the device, fwd_bwd or update (args kind, step, source: staged,
# inline or resident), from when it could start to when its output was ready.
DEVICE_COMPUTE = "device/compute"
DEVICE_SYNC = "device/sync"  # a step boundary's weight sync (the embedded host emulates one)
TRAINER_LANE = "trainer/lane"  # a compute-lane call that is no computation (a weight sync, ...)
TRAINER_H2D = "trainer/h2d"  # a placement: preparation and host-to-device copy (args lane, bytes)
TRAINER_DECODE = "trainer/decode"  # a compressed payload decoded before its placement
TRAINER_RECEIVE = "trainer/receive"  # a call's bytes arriving (args transport, bytes)
TRAINER_POOL_WAIT = "trainer/pool-wait"  # a call's bytes waiting for the bounded receive pool
TRAINER_FALLBACK = "trainer/fallback"  # a received batch never placed, trained from its payload
# The orchestrator's.
ORCHESTRATOR_STAGE = "orchestrator/stage"  # a stage call as the pipeline saw it
ORCHESTRATOR_TRAIN = "orchestrator/train"  # a train call (args step, index, staged)
ORCHESTRATOR_SEND = "orchestrator/send"  # a call carrying a micro-batch (args transport, bytes)

# A DEVICE_COMPUTE span's kind (its args' `kind`): a micro-batch's computation, and the one that
# ends a step (its optimizer update). The hosts' trainers name their calls so too.
FWD_BWD, UPDATE = "fwd_bwd", "update"
