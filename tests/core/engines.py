"""An in-process StageEngine over the real core parts, for the core's tests.

It uses the real StagedBatchStore and MethodExecutor (real threads: stage on the staging lane,
train on the compute lane, placement on a placer thread, as the hosts' trainers do), so only the
RPC hop is missing; the embedded host adds real gRPC. Failures are scripted per payload so tests
can say exactly which fallbacks they expect.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from tunix_stage_plugin.core import executor as executor_lib
from tunix_stage_plugin.core.contract import StageOutcome, StagedPayloadUnreadable
from tunix_stage_plugin.core.contract import Trained
from tunix_stage_plugin.core import store as store_lib
from tunix_stage_plugin.core import contract

OK, PREPARE_FAILS, LOST_REPLY = "ok", "prepare_fails", "lost_reply"
# Staged, but its train call finds the staged bytes unreadable (a damaged compressed payload):
# the trainer takes the key and trains nothing.
UNREADABLE = "unreadable"


class LostReply(ConnectionError):
  """The stage happened on the trainer, but its answer never reached the orchestrator."""


def trainer_executor(name: str = "trainer", **kwargs: Any) -> executor_lib.MethodExecutor:
  """A MethodExecutor with tunix's trainer lane table (core/contract.py)."""
  return executor_lib.MethodExecutor(staging_methods=contract.STAGING_METHODS,
                                     light_methods=contract.LIGHT_METHODS, name=name, **kwargs)


class TrainFailed(RuntimeError):
  pass


class ThreadedEngine:

  def __init__(self, max_device_batches: int = 1, *, stage_outcomes: dict[Any, str] | None = None,
               stage_delay_s: dict[Any, float] | None = None, fail_train: set[Any] = frozenset(),
               stage_gate: dict[Any, threading.Event] | None = None,
               train_gate: dict[Any, threading.Event] | None = None,
               slot_wait_s: float = 30.0, fail_train_before_take: set[Any] = frozenset(),
               on_event: Any = None, max_host_batches: int = 1) -> None:
    self.store = store_lib.StagedBatchStore(max_device_batches, max_host_batches=max_host_batches,
                                            slot_wait_s=slot_wait_s)
    # A stage is answered once received (stage_gate and stage_delay_s hold the call on its way
    # in); the placer thread places it (PREPARE_FAILS fails the placement).
    self.placer = threading.Thread(target=self._placing, daemon=True, name="test-placer")
    self.placer.start()
    self.executor = trainer_executor(name="test")
    self.stage_outcomes = stage_outcomes or {}
    self.stage_delay_s = stage_delay_s or {}
    self.stage_gate = stage_gate or {}
    self.train_gate = train_gate or {}
    self.fail_train = set(fail_train)
    # Fails a train call before the trainer takes its staged batch (a call lost on the way).
    self.fail_train_before_take = set(fail_train_before_take)
    self.on_event = on_event  # called with each logged event (from any thread)
    self.key_payload: dict[str, Any] = {}
    self.trained: list[Any] = []  # payloads in training order
    self.trained_staged: list[bool] = []
    self.updates: list[int] = []  # len(trained) at each optimizer step
    self.attempts: list[tuple[Any, str]] = []  # (payload, ok|refused|prepare_fails|lost_reply)
    self.events: list[str] = []  # ordered log across threads, for ordering assertions
    self._log_lock = threading.Lock()

  def log(self, event: str) -> None:
    with self._log_lock:
      self.events.append(event)
    if self.on_event is not None:
      self.on_event(event)

  def _prepare(self, payload: Any) -> Any:
    if self.stage_outcomes.get(payload) == PREPARE_FAILS:
      raise RuntimeError(f"injected prepare failure for {payload!r}")
    return ("placed", payload)

  def _placing(self) -> None:
    for job in self.store.placements():
      with job:
        job.done(self._prepare(job.payload))

  def _stage(self, payload: Any, key: str) -> StageOutcome:
    self.log(f"stage-start {payload}")
    self.key_payload[key] = payload
    gate = self.stage_gate.get(payload)  # the call held on its way in
    if gate is not None and not gate.wait(timeout=30):
      raise TimeoutError(f"stage gate for {payload!r} never opened")
    time.sleep(self.stage_delay_s.get(payload, 0.0))  # emulated wire time
    result = self.store.receive(key, payload)
    if result.staged:
      attempt = LOST_REPLY if self.stage_outcomes.get(payload) == LOST_REPLY else OK
    else:
      attempt = "refused"
    self.attempts.append((payload, attempt))
    self.log(f"stage-end {payload}")
    if attempt == LOST_REPLY:
      raise LostReply(f"reply for {key} lost")
    return result

  async def stage(self, payload: Any, *, key: str) -> StageOutcome:
    return await self.executor.run("stage_batch", self._stage, payload, key)

  def _train(self, payload: Any, stage_key: str | None, apply_optimizer: bool
             ) -> tuple[int, str | None]:
    name = payload if stage_key is None else self.key_payload.get(stage_key)
    if name in self.fail_train_before_take:
      raise TrainFailed(f"injected train failure before take for {name!r}")
    fallback = None
    if stage_key is not None:
      assert payload is None, "a train call with a stage key must not carry the payload"
      try:
        tag, payload = self.store.take(stage_key)
        assert tag == "placed"
      except store_lib.PlacementFailed as e:  # received, never placed: train its payload
        payload, fallback = e.payload, e.reason
        self.attempts.append((payload, "unplaced"))
      if self.stage_outcomes.get(payload) == UNREADABLE:
        self.attempts.append((payload, UNREADABLE))
        raise StagedPayloadUnreadable(f"staged payload {payload!r} did not decode")
    self.log(f"train {payload}")
    gate = self.train_gate.get(payload)
    if gate is not None and not gate.wait(timeout=30):
      raise TimeoutError(f"train gate for {payload!r} never opened")
    if payload in self.fail_train:
      raise TrainFailed(f"injected train failure for {payload!r}")
    self.trained.append(payload)
    self.trained_staged.append(stage_key is not None and fallback is None)
    if apply_optimizer:
      self.updates.append(len(self.trained))
    return len(self.trained), fallback

  async def train(self, payload: Any, *, stage_key: str | None, apply_optimizer: bool
                  ) -> Trained:
    result, fallback = await self.executor.run("fwd_bwd", self._train, payload, stage_key,
                                               apply_optimizer)
    return Trained(result, fallback)

  async def reset(self, keys: list[str]) -> None:
    await self.executor.run("reset_staged", self.store.reset, keys)

  def close(self) -> None:
    self.executor.close()
    self.store.close()
    self.placer.join(10)


async def source_of(payloads: list[Any], pull_delay_s: float = 0.0):
  """An async micro-batch source; the last payload closes the step."""
  from tunix_stage_plugin.core.pipeline import MicroBatch

  for i, p in enumerate(payloads):
    if pull_delay_s:
      await asyncio.sleep(pull_delay_s)  # emulated group-pull latency
    yield MicroBatch(p, closes_step=i == len(payloads) - 1)
