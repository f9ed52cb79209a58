"""A staged micro-batch's way on the embedded host, measured with a profile hook (tests/way.py):
the plugin files its calls pass through (the lab's own included: the embedded host is the lab's),
from the pipeline's pull of it to the return of its train call by key, in every thread of both
ends (the trainer's server, lanes, placer and bulk listener, and the orchestrator's loop, here in
one process over real gRPC and the bulk channel on 127.0.0.1). At most 14 files, none called back
up into from below, and the files docs/design.md's table names.

The step runs as the embedded job runs one (lab/embedded/job.py), at the default depth (auto),
its micro-batches large enough to cross the bulk channel.
"""

from __future__ import annotations

import asyncio
import dataclasses

from tests import way as way_lib
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.core import pipeline as pipeline_lib
from tunix_stage_plugin.core import sizing
from tunix_stage_plugin.core.telemetry import process as telemetry_lib
from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import server as server_lib
from tunix_stage_plugin.lab.embedded import worker as worker_lib

MOST_FILES = 14
# Micro-batches of ~2 MiB: over the client's bulk threshold, so each call carrying one crosses
# the bulk channel.
SIZES = dataclasses.replace(data_lib.TINY_SIZES, ballast=8192)


MarkedEngine = way_lib.marking(client_lib.EmbeddedEngine)  # marks the window's end


def test_a_staged_micro_batch_crosses_at_most_14_files_and_never_goes_back_up():
  way = way_lib.Way(lab=True).start()  # before any thread of the server or its lanes starts
  try:
    cfg = config_lib.resolve({"mode": "stage"}, env={})
    worker = worker_lib.TrainerWorker(cfg)
    executor = worker_lib.make_executor(cfg)
    server = server_lib.WorkerServer(worker, executor, timeline=worker.recorder, pool=worker.pool)

    async def main():
      port = await server.start(0)
      try:
        async with client_lib.WorkerClient(f"127.0.0.1:{port}") as client:
          await client.wait_ready(60)
          await client.call("setup", sizes=SIZES.as_dict(), record_timeline=False)  # as a job
          engine = MarkedEngine(client)
          engine.way = way
          telemetry = telemetry_lib.Telemetry(telemetry_lib.Settings(host="embedded",
                                                                     log_every=0))
          telemetry.orchestrator()
          engine.recorder = telemetry.recorder
          auto = engine.auto = sizing.AutoDepth(cfg.memory_budget, telemetry)
          pipeline = pipeline_lib.StagePipeline(
              engine, 2, recorder=telemetry.recorder, depth_for=auto.depth_for, room=auto.room)
          make = data_lib.BatchMaker(SIZES, 0)

          async def source(step):
            for index in range(3):
              if step == 1 and index == 1:
                engine.key = contract.build_key(pipeline.key_prefix, step, index)
                way.mark("start")  # its pull: its stage call comes next
              yield pipeline_lib.MicroBatch(make(step, index), closes_step=index == 2)

          try:
            await pipeline.run_step(0, source(0))  # compiles, connects the bulk channel
            profiled = await pipeline.run_step(1, source(1))
          finally:
            auto.close()
          return profiled
      finally:
        await server.stop(1.0)

    profiled = asyncio.run(main())
  finally:
    way.stop()
    executor.close()
    worker.close()
  assert profiled.staged >= 1 and profiled.fallbacks == 0, profiled
  way_lib.check(way, "embedded", MOST_FILES)
