"""The embedded host end to end: a real JAX trainer process, real gRPC on 127.0.0.1, tiny sizes.

No timing is asserted: only what was trained, in which order, with which parameters, and what
was staged, refused, failed and left behind.
"""

from __future__ import annotations

import pytest

from tests.embedded.support import TINY, call, inline_digest_of, no_new_threads, run_plan
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.embedded import job as job_lib
from tunix_stage_plugin.lab.embedded import process as process_lib

STEPS, MB = 3, 4
EXPECTED = data_lib.expected_order(STEPS, MB)
PLANS = {
    "inline": job_lib.JobPlan(STEPS, MB, kind="inline"),
    "depth1": job_lib.JobPlan(STEPS, MB, kind="staged", depth=1),
    "depth2": job_lib.JobPlan(STEPS, MB, kind="staged", depth=2),
    "depth2_prestage": job_lib.JobPlan(STEPS, MB, kind="staged", depth=2, prestage=True,
                                       sync_s=0.01),
    "resident": job_lib.JobPlan(STEPS, MB, kind="resident"),
}


@pytest.fixture(scope="module")
def inline_digest(trainer):
  return inline_digest_of(trainer.address, STEPS, MB)


@pytest.mark.parametrize("mode", list(PLANS))
def test_every_mode_trains_each_micro_batch_once_in_order_to_the_same_parameters(
    trainer, inline_digest, mode):
  result = run_plan(trainer.address, PLANS[mode])
  assert result.finish["trained_order"] == EXPECTED
  assert result.finish["param_digest"] == inline_digest
  assert result.finish["updates"] == STEPS
  assert result.fallbacks == [0] * STEPS
  store = result.finish["store"]
  assert store["peak"] <= 2
  assert store["staged"] == store["consumed"]  # nothing left staged
  reports = [o.report for o in result.outcomes]
  if mode in ("inline", "resident"):
    assert store["staged"] == 0 and all(r.staged == 0 for r in reports)
  else:
    assert sum(r.staged for r in reports) == store["consumed"] > 0
  if mode == "depth2_prestage":
    assert [r.prestaged > 0 for r in reports] == [False, True, True]


def test_a_payload_larger_than_a_chunk_arrives_intact_when_staged(trainer):
  sizes = TINY.with_payload_mib(9)  # streamed as three chunks
  inline = run_plan(trainer.address, job_lib.JobPlan(2, 2, kind="inline"), sizes=sizes)
  staged = run_plan(trainer.address, job_lib.JobPlan(2, 2, kind="staged", depth=2), sizes=sizes)
  assert staged.finish["param_digest"] == inline.finish["param_digest"]
  assert staged.finish["store"]["consumed"] > 0


def test_a_bound_of_one_is_never_exceeded(trainer, inline_digest):
  result = run_plan(trainer.address, PLANS["depth2_prestage"], max_device_batches=1)
  assert result.finish["max_device_batches"] == 1
  assert result.finish["store"]["peak"] == 1
  assert result.finish["trained_order"] == EXPECTED
  assert result.finish["param_digest"] == inline_digest


def test_a_stage_failing_in_the_worker_falls_back_inline_and_is_counted(trainer, inline_digest):
  failing = ["s1-m1", "s2-m2"]
  result = run_plan(trainer.address, PLANS["depth2_prestage"], fail_stage=failing)
  assert result.fallbacks == [0, 1, 1]
  reasons = [r for o in result.outcomes for r in o.report.fallback_reasons]
  assert all("injected stage failure" in r for r in reasons), reasons
  assert result.finish["store"]["failed"] == 2
  assert result.finish["trained_order"] == EXPECTED
  assert result.finish["param_digest"] == inline_digest
  assert call(trainer.address, "info")["staged_keys"] == []


def test_inline_only_starts_no_staging_thread_and_shutdown_leaves_nothing():
  with no_new_threads():
    with process_lib.TrainerProcess(max_device_batches=2) as proc:
      run_plan(proc.address, PLANS["inline"])
      threads = call(proc.address, "info")["threads"]
      assert any("compute" in t for t in threads)
      assert not any("staging" in t for t in threads), threads
    assert proc.proc.returncode == 0


def test_a_trainer_with_staging_off_refuses_every_stage_without_a_staging_thread(inline_digest):
  with process_lib.TrainerProcess(mode="off") as proc:
    result = run_plan(proc.address, PLANS["depth2"])
    info = call(proc.address, "info")
  assert proc.proc.returncode == 0
  assert info["mode"] == "off" and not any("staging" in t for t in info["threads"])
  # The trainer is asked once: it answers that it cannot stage at all, and every micro-batch
  # after that trains inline without an offer (no payload sent twice).
  assert result.fallbacks == [1] + [0] * (STEPS - 1)
  assert [r for o in result.outcomes for r in o.report.fallback_reasons] == [
      "unsupported: staging is off on this trainer (TUNIX_STAGE_BATCH=off)"]
  assert all(o.report.inline == MB for o in result.outcomes)
  assert result.finish["store"]["staged"] == 0
  assert result.finish["param_digest"] == inline_digest


def test_the_array_layout_is_what_a_micro_batch_holds():
  for payload in data_lib.PAYLOADS:
    sizes = data_lib.TINY_SIZES.with_payload(payload)
    batch = data_lib.make_batch(sizes, 0, 1, 2)
    assert {k: (a.shape, str(a.dtype)) for k, a in batch.arrays.items()} == sizes.array_layout()
