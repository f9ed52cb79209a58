"""Many clients staging at once against one real trainer process (issue 22): a received batch's
placement runs next on the staging lane, so it never waits behind the stages queued after it."""

from __future__ import annotations

import asyncio

from tunix_stage_plugin.lab.embedded import client as client_lib
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import process as process_lib

CLIENTS, ROUNDS = 24, 6
GUARD_S = 120  # a hang guard, not a timing assertion: the load takes seconds when placement is first


def test_many_concurrent_clients_stage_train_and_reset_and_leave_nothing_staged():
  make = data_lib.BatchMaker(data_lib.TINY_SIZES, 0)

  async def client(address: str, n: int) -> list[tuple[str, str, str]]:
    """Each round stages one micro-batch; a staged one is trained by key (even rounds) or
    reset (odd rounds), a refused one trained inline. Returns (key, answer, what became of it)."""
    done = []
    async with client_lib.WorkerClient(address) as worker:
      for r in range(ROUNDS):
        key, batch = f"c{n}-r{r}", make(n, r)
        answer = await worker.call("stage_batch", batch, key=key)
        if answer["status"] != "staged":
          trained = await worker.call("fwd_bwd", batch)
          done.append((key, answer["status"], trained["source"]))
        elif r % 2 == 0:
          trained = await worker.call("fwd_bwd", stage_key=key)
          done.append((key, "staged", trained["source"]))
        else:
          dropped = await worker.call("reset_staged", [key])
          done.append((key, "staged", "reset" if dropped == [key] else f"reset {dropped}"))
    return done

  async def load(address: str) -> tuple[list[list[tuple[str, str, str]]], dict, dict]:
    async with client_lib.WorkerClient(address) as boss:
      await boss.wait_ready()
      await boss.call("setup", sizes=data_lib.TINY_SIZES.as_dict(), seed=0, record_timeline=False)
      results = await asyncio.wait_for(
          asyncio.gather(*(client(address, n) for n in range(CLIENTS))), GUARD_S)
      return results, await boss.call("info"), await boss.call("finish")

  with process_lib.TrainerProcess() as trainer:  # bounds 1 device, 1 host batch (the defaults)
    results, info, finish = asyncio.run(load(trainer.address))
  assert trainer.proc.returncode == 0
  rows = [row for result in results for row in result]
  assert len(rows) == CLIENTS * ROUNDS
  staged = [row for row in rows if row[1] == "staged"]
  # Every answered-STAGED key was consumed (from its placement, or its payload when placement
  # failed) or reset; nothing is left on the trainer.
  assert {fate for _, _, fate in staged} <= {"staged", "unplaced", "reset"}, staged
  assert info["staged_keys"] == []
  store = finish["store"]
  trained_by_key = [row for row in staged if row[2] != "reset"]
  assert store["consumed"] + store["unplaced"] == len(trained_by_key)
  assert store["dropped"] == len(staged) - len(trained_by_key)
  # Placement never waited behind the queued stages: no stage was refused for the host buffer
  # the unplaced batch held. (A train call that overtakes another client's may find its batch
  # still waiting for the slot that other batch holds: it trains from its payload, "unplaced".)
  assert [row for row in rows if row[1] != "staged"] == []
  assert store["refused"] == 0
  assert len(finish["trained_order"]) == len(trained_by_key)
