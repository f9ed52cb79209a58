"""Helpers for the embedded-host tests: run a plan against a real trainer over real gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, Iterator

import grpc

from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import engine as engine_lib
from tunix_stage_plugin.lab.embedded import job as job_lib

TINY = data_lib.TINY_SIZES


@dataclasses.dataclass
class PlanResult:
  outcomes: list[job_lib.StepOutcome]
  finish: dict[str, Any]
  wire: engine_lib.WireStats | None = None

  @property
  def fallbacks(self) -> list[int]:
    return [o.report.fallbacks for o in self.outcomes]


async def run_plan_async(address: str, plan: job_lib.JobPlan, *,
                         sizes: data_lib.Sizes = TINY, seed: int = 0,
                         engine: Callable[[client_lib.WorkerClient], engine_lib.EmbeddedEngine]
                         = engine_lib.EmbeddedEngine,
                         **setup: Any) -> PlanResult:
  async with client_lib.WorkerClient(address) as client:
    await client.wait_ready()
    await client.call("setup", sizes=sizes.as_dict(), seed=seed, **setup)
    the_engine = engine(client)
    outcomes = await job_lib.run_job(
        the_engine, plan,
        data_lib.BatchMaker(sizes, seed))
    return PlanResult(outcomes, await client.call("finish"), the_engine.wire)


def run_plan(address: str, plan: job_lib.JobPlan, **kwargs: Any) -> PlanResult:
  return asyncio.run(run_plan_async(address, plan, **kwargs))


def call(address: str, method: str, *args: Any, **kwargs: Any) -> Any:
  async def go() -> Any:
    async with client_lib.WorkerClient(address) as client:
      return await client.call(method, *args, **kwargs)
  return asyncio.run(go())


def _warm_grpc_aio() -> None:
  """grpcio starts one process-wide aio poller thread on first use and never joins it."""
  async def go() -> None:
    channel = grpc.aio.insecure_channel("127.0.0.1:9")
    await channel.close()
  asyncio.run(go())


@contextlib.contextmanager
def no_new_threads() -> Iterator[None]:
  """Fails if the block leaves a Python thread behind (grpcio's own poller excepted, see above)."""
  _warm_grpc_aio()
  before = set(threading.enumerate())
  yield
  left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
  assert not left, f"threads left running: {left}"


def inline_digest_of(address: str, steps: int, microbatches: int, **kwargs: Any) -> str:
  """The parameter digest of an inline run (every micro-batch with its train call): the
  reference every staged run must reach."""
  result = run_plan(address, job_lib.JobPlan(steps, microbatches, kind="inline"), **kwargs)
  assert result.finish["trained_order"] == data_lib.expected_order(steps, microbatches)
  return result.finish["param_digest"]


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
  """Polls `predicate` until it is true (returns its value) or `timeout_s` passes (fails)."""
  deadline = time.monotonic() + timeout_s
  while True:
    value = predicate()
    if value:
      return value
    if time.monotonic() > deadline:
      raise AssertionError(f"{what}: not within {timeout_s:g} s")
    time.sleep(0.05)  # a polling interval, not a synchronisation


def process_state(pid: int) -> str:
  """The process's state letter from /proc (R, S, T for stopped, Z, ...)."""
  with open(f"/proc/{pid}/stat", encoding="ascii") as f:
    return f.read().rsplit(")", 1)[1].split()[0]
