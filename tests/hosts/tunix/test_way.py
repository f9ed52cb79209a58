"""A staged micro-batch's way on tunix's host, measured with a profile hook (tests/way.py): the
plugin files its calls pass through, from the pipeline's pull of it to the return of its train call
by key, in every thread of both ends (the trainer's server, lanes, placer and side-channel
listener, and the orchestrator's loop, here in one process over real gRPC on 127.0.0.1). At most
14 files, none called back up into from below, and the files docs/design.md's table names.

The step runs the pipeline as a staged train_stage does (hosts/tunix/run.py), at the default depth
(auto) over 2 MiB micro-batches, so each stage and inline train crosses the bulk side channel.
"""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

# pylint: disable=wrong-import-position
from tests import way as way_lib
from tests.hosts.tunix.test_side import staging  # pylint: disable=unused-import  (the fixture)
from tests.hosts.tunix.test_stream import RecordingTrainer, big, close, serve
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.core import sizing
from tunix_stage_plugin.hosts.tunix import orchestrator

from tunix.experimental.worker import trainer_worker

pytestmark = pytest.mark.tunix
MOST_FILES = 14


class Trainer(RecordingTrainer):
  """RecordingTrainer with what the telemetry reads of a PeftTrainer (no tracer, no metrics
  logger, a loss to watch), as tunix's own has."""

  _perf_tracer_v2 = None
  metrics_logger = None
  _buffered_train_metrics = types.SimpleNamespace(losses=[np.float32(0.0)])
  _last_update_grad_norm = np.float32(0.0)


MarkedCalls = way_lib.marking(orchestrator.StagingCalls)  # marks the window's end


def test_a_staged_micro_batch_crosses_at_most_14_files_and_never_goes_back_up(staging):
  way = way_lib.Way().start()  # before any thread of the server, its lanes or listener starts
  try:
    worker = trainer_worker.TrainerWorker(Trainer)
    worker.initialize()

    async def main():
      server, handle, engine = await serve(worker)
      side = staging.orchestrator_side()
      calls = MarkedCalls(side, engine)
      calls.way = way
      auto = calls.auto = sizing.AutoDepth(staging.live.config.memory_budget, staging.telemetry)
      pipeline = pipeline_lib.StagePipeline(
          calls, 2, key_prefix=contract.next_loop_prefix(), recorder=staging.recorder,
          depth_for=auto.depth_for, room=auto.room)

      async def source(step):
        for index in range(3):
          if step == 1 and index == 1:
            calls.key = contract.build_key(pipeline.key_prefix, step, index)
            way.mark("start")  # its pull: its stage call comes next
          yield pipeline_lib.MicroBatch(big(10 * step + index, mib=2), closes_step=index == 2)

      try:
        first = await pipeline.run_step(0, source(0))  # connections, the side channel, lanes
        # Its step closed on the trainer (the watcher saw its update) before the next one starts.
        assert await asyncio.to_thread(staging.drain, 30)
        profiled = await pipeline.run_step(1, source(1))
      finally:
        auto.close()
        await close(server, handle, engine)
      return first, profiled

    first, profiled = asyncio.run(main())
  finally:
    way.stop()
  assert profiled.staged >= 1 and profiled.fallbacks == 0, profiled
  # The side channel carried the stages.
  assert staging.trainer_side().bulk_calls["stage_batch"] >= 2
  way_lib.check(way, "tunix", MOST_FILES)
