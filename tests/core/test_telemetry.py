"""The telemetry core: the recorder's fan-out, the compute watcher over real JAX computations,
the step aggregators' arithmetic, the record file (read back by the reading layer), the per-step
line, the scalars from the one table of figures.

The trainer aggregator is fed spans built here (its input is spans, whoever records them): each
test builds a step whose idle, transfers and lane calls it knows, and checks the figures against
what it built. The orchestrator's figures come from a real pipeline run (tests/core/engines.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import pytest

from tests.core.engines import ThreadedEngine, source_of
from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.core.contract import StageStatus
from tunix_stage_plugin.core.pipeline import Fallback, StagePipeline, StepReport
from tunix_stage_plugin.core.telemetry import figures as figures_lib
from tunix_stage_plugin.core.telemetry import lines
from tunix_stage_plugin.core.telemetry import process
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.core.telemetry.recorder import Span
from tunix_stage_plugin.lab.bench import trace as trace_lib
from tunix_stage_plugin.reading import records as records_lib
from tunix_stage_plugin.reading import runs as runs_lib

MIB = 1 << 20


def test_a_recorder_tells_every_sink_and_drops_one_that_raises(caplog):
  rec = recorder_lib.Recorder()
  kept = trace_lib.Kept()

  class Broken:
    def record(self, span):
      raise OSError("disk full")

  rec.add_sink(Broken())
  rec.add_sink(kept)
  with caplog.at_level(logging.WARNING, logger="tunix_stage_plugin"):
    with rec.span(tracks.TRAINER_H2D, "s0-m1", lane="staging") as args:
      args["bytes"] = 7
    rec.add(tracks.TRAINER_RECEIVE, "stage_batch", 1.0, 2.0, transport="side", bytes=3)
  assert [(s.track, dict(s.args)) for s in kept.spans()] == [
      (tracks.TRAINER_H2D, {"lane": "staging", "bytes": 7}),
      (tracks.TRAINER_RECEIVE, {"transport": "side", "bytes": 3})]
  assert [r.message for r in caplog.records] == [
      "tunix-stage: telemetry: Broken failed (OSError: disk full) and was dropped; staging goes on"]


def test_the_disabled_recorder_takes_no_sink_and_records_nothing():
  with pytest.raises(RuntimeError, match="disabled"):
    recorder_lib.DISABLED.add_sink(trace_lib.Kept())
  with recorder_lib.DISABLED.span(tracks.TRAINER_H2D, "x", lane="inline") as args:
    assert args == {"lane": "inline"}
  assert not recorder_lib.DISABLED.enabled


def test_the_watcher_records_each_computation_when_its_output_is_ready():
  """Real JAX computations, dispatched asynchronously: the call answers before the output is
  ready, and the watcher, on its own thread, records the device span once it is."""
  rec = recorder_lib.Recorder()
  kept = trace_lib.Kept()
  rec.add_sink(kept)
  watcher = recorder_lib.ComputeWatcher(rec, jax.block_until_ready)
  work = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((512, 512))
  work(x).block_until_ready()  # compiled
  queued = []
  for kind in ("fwd_bwd", "fwd_bwd", "update"):
    start = time.perf_counter()
    out = work(x)
    queued.append(start)
    watcher.dispatched(kind, start, time.perf_counter(), out, step=0)
  assert watcher.drain(30)
  spans = kept.spans(tracks.DEVICE_COMPUTE)
  assert [s.name for s in spans] == ["fwd_bwd", "fwd_bwd", "update"]
  for i, s in enumerate(spans):
    assert s.start >= queued[i] and s.end >= s.start
    if i:
      assert s.start >= spans[i - 1].end  # one device: it starts once the one before ended
  assert dict(spans[0].args)["step"] == 0
  watcher.close()


def test_a_failed_computation_is_not_recorded_and_the_watcher_goes_on():
  rec = recorder_lib.Recorder()
  kept = trace_lib.Kept()
  rec.add_sink(kept)

  def wait(output):
    if output == "broken":
      raise RuntimeError("XLA error")

  watcher = recorder_lib.ComputeWatcher(rec, wait)
  watcher.dispatched("fwd_bwd", 0.0, 0.0, "broken")
  watcher.dispatched("update", 0.0, 0.0, "fine")
  assert watcher.drain(10)
  assert [s.name for s in kept.spans()] == ["update"]
  watcher.close()


def test_the_watcher_waits_once_and_then_tells_what_needs_the_end(caplog):
  """One wait per computation: what else needs its end (tunix's PerfTracer's device span) is told
  by the watcher after its span is recorded; one that raises is said and the watcher goes on."""
  rec = recorder_lib.Recorder()
  kept = trace_lib.Kept()
  rec.add_sink(kept)
  waited, told = [], []

  def broken():
    raise KeyError("no timeline")

  watcher = recorder_lib.ComputeWatcher(rec, waited.append)
  watcher.dispatched("fwd_bwd", 0.0, 0.0, "a", on_ready=lambda: told.append(len(kept.spans())))
  watcher.dispatched("fwd_bwd", 0.0, 0.0, "b")
  with caplog.at_level(logging.WARNING, logger="tunix_stage_plugin"):
    watcher.dispatched("fwd_bwd", 0.0, 0.0, "c", on_ready=broken)
    watcher.dispatched("update", 0.0, 0.0, "d", on_ready=lambda: told.append(len(kept.spans())))
    assert watcher.drain(10)
  assert waited == ["a", "b", "c", "d"]
  assert told == [1, 4]  # each after its own span was recorded
  assert [r.message for r in caplog.records] == [
      "tunix-stage: telemetry: telling the end of a fwd_bwd computation failed (KeyError: "
      "'no timeline')"]
  watcher.close()


def compute(kind, start, end, **args):
  return Span(tracks.DEVICE_COMPUTE, kind, start, end, tuple(sorted({"kind": kind, **args}.items())))


def test_a_trainer_step_splits_into_compute_input_wait_and_other_calls():
  """Two steps; the second: a weight sync (a lane call) in the boundary and 0.2 s of idle before
  it, a 0.3 s gap mid-step, a 0.1 s gap covered by an eval call on the lane, and one fwd_bwd
  running beside a receive (slower than the two that ran alone)."""
  steps = []
  agg = recorder_lib.TrainerSteps(steps.append, peaks=lambda: (2, 1))
  feed = [
      compute("fwd_bwd", 0.0, 1.0), compute("update", 1.0, 1.2),
      Span(tracks.TRAINER_LANE, "prepare_weight_sync", 1.2, 1.5, (("method", "sync"),)),
      # idle 1.5 -> 1.7: waiting for the first micro-batch (boundary)
      Span(tracks.TRAINER_RECEIVE, "stage_batch", 1.6, 2.1,
           (("bytes", 8 * MIB), ("transport", "side"))),
      Span(tracks.TRAINER_H2D, "s1-m1", 2.1, 2.2, (("bytes", 8 * MIB), ("lane", "staging"))),
      compute("fwd_bwd", 1.7, 2.7),  # beside the receive and placement: 1.0 s
      compute("fwd_bwd", 3.0, 3.6),  # 0.3 s idle before it (mid-step)
      Span(tracks.TRAINER_LANE, "eval", 3.6, 3.7, (("method", "eval"),)),
      compute("fwd_bwd", 3.7, 4.3),  # after the eval: that gap is no input wait
      Span(tracks.TRAINER_POOL_WAIT, "pool wait", 2.0, 2.05, (("bytes", 8 * MIB), ("over", True))),
      compute("update", 4.3, 4.5),
  ]
  for span in feed:
    agg.record(span)
  first, second = steps
  assert first["step"] == 0 and first["step_s"] is None
  assert first["input_wait_s"] == {"mid_step": 0.0, "boundary": None}
  assert second["step"] == 1
  assert second["step_s"] == pytest.approx(4.5 - 1.2)
  assert second["compute_s"] == pytest.approx(1.0 + 0.6 + 0.6 + 0.2)
  assert second["input_wait_s"]["mid_step"] == pytest.approx(0.3)
  assert second["input_wait_s"]["boundary"] == pytest.approx(0.2)
  assert second["other_s"] == pytest.approx(0.3 + 0.1)
  assert second["microbatches"] == 3
  c = second["compute"]
  # Alone: step 0's 1.0 s and this step's two 0.6 s fwd_bwd (median 0.6).
  assert c["beside_transfer"] == 1 and c["alone_s"] == pytest.approx(0.6)
  assert c["slowdown_s"] == pytest.approx(1.0 - 0.6)
  assert second["receive"] == {"calls": 1, "bytes": 8 * MIB, "seconds": pytest.approx(0.5),
                               "by_transport": {"side": {"calls": 1, "bytes": 8 * MIB,
                                                         "seconds": pytest.approx(0.5)}}}
  assert second["place"]["staged"] == 1 and second["place"]["inline"] == 0
  assert second["pool"] == {"waits": 1, "wait_s": pytest.approx(0.05), "over_bound": 1}
  assert second["staged"] == {"peak_device": 2, "peak_host": 1}
  assert second["bound_by"] == figures_lib.WIRE  # 0.5 s of input wait in a 3.3 s step


def beside_every_fwd_bwd(t):
  """A step from `t` whose two fwd_bwd (0.9 s each) each have a receive beside them."""
  return [Span(tracks.TRAINER_RECEIVE, "stage_batch", t, t + 0.8,
               (("bytes", MIB), ("transport", "side"))), compute("fwd_bwd", t, t + 0.9),
          Span(tracks.TRAINER_RECEIVE, "stage_batch", t + 0.9, t + 1.7,
               (("bytes", MIB), ("transport", "side"))), compute("fwd_bwd", t + 0.9, t + 1.8),
          compute("update", t + 1.8, t + 2.0)]


def test_a_slowdown_without_a_baseline_is_unknown_and_a_restart_keeps_the_baseline():
  """Every fwd_bwd beside a transfer: no baseline, so no slowdown, and the line says so. A run
  whose process computed alone before (the bench's earlier mode) keeps that baseline across
  telemetry.restart(), and its steps then say how much the shared cores cost."""
  tel = process.Telemetry(process.Settings(host="test", log_every=0))
  agg = tel.trainer()
  for span in beside_every_fwd_bwd(0.0):
    agg.record(span)
  (first,) = tel.history["trainer"]
  assert first["compute"]["alone_s"] is None and first["compute"]["slowdown_s"] is None
  assert first["compute"]["beside_transfer"] == 2
  assert "compute 2.00 (its slowdown beside transfers unknown) + input wait" in \
      lines.trainer_line(first)
  assert first["bound_by"] == figures_lib.COMPUTE  # no input wait; the slowdown not known
  for span in [compute("fwd_bwd", 2.0, 2.6), compute("update", 2.6, 2.8)]:  # one ran alone
    agg.record(span)
  tel.restart()
  for span in beside_every_fwd_bwd(3.0) + beside_every_fwd_bwd(5.0):
    tel.trainer().record(span)
  _, second = tel.history["trainer"]
  assert second["compute"]["alone_s"] == pytest.approx(0.6)  # from before the restart
  assert second["compute"]["slowdown_s"] == pytest.approx(2 * (0.9 - 0.6))
  assert second["bound_by"] == figures_lib.SHARED_CORES
  # The slowdown is part of the compute: said inside it, so the step's sum reads as a sum.
  assert "= compute 2.00 (0.60 of it slower beside transfers) + input wait 0.00 mid-step" in \
      lines.trainer_line(second)


def test_the_bound_follows_the_largest_loss():
  """bound_by(step, input wait, slowdown) of a 2 s step."""
  assert figures_lib.bound_by(2.0, 0.0, 0.0) == figures_lib.COMPUTE
  assert figures_lib.bound_by(2.0, 0.0, 0.5) == figures_lib.SHARED_CORES
  assert figures_lib.bound_by(2.0, 0.01 + 0.3, 0.0) == figures_lib.WIRE
  # Under the floor (5 % of the step and 20 ms) nothing counts; an unknown slowdown neither.
  assert figures_lib.bound_by(2.0, 0.05, 0.0) == figures_lib.COMPUTE
  assert figures_lib.bound_by(2.0, 0.0, None) == figures_lib.COMPUTE


def test_the_orchestrator_figures_count_a_real_pipeline_s_calls_by_step():
  """A real pipeline over the core's engine; sends recorded inside its calls count in their
  step through the call's context."""
  tel = process.Telemetry(process.Settings(host="test", log_every=0))
  engine = ThreadedEngine(2)

  class Sending:
    async def stage(self, payload, *, key):
      step, _ = recorder_lib.CALL.get()
      tel.recorder.add(tracks.ORCHESTRATOR_SEND, "stage_batch", 0.0, 0.5, transport="side",
                       bytes=MIB, step=step)
      return await engine.stage(payload, key=key)

    async def train(self, payload, *, stage_key, apply_optimizer):
      return await engine.train(payload, stage_key=stage_key, apply_optimizer=apply_optimizer)

    async def reset(self, keys):
      await engine.reset(keys)

  tel.orchestrator()  # this process orchestrates: its aggregator listens
  pipeline = StagePipeline(Sending(), 2, recorder=tel.recorder)
  figures = []

  async def main():
    for step in range(2):
      report = await pipeline.run_step(step, source_of([step * 10 + i for i in range(4)]))
      figures.append(tel.orchestrator_step(report, depth=2))

  try:
    asyncio.run(main())
  finally:
    engine.close()
  for f in figures:
    assert f["microbatches"] == 4 and f["staged"] + f["inline"] == 4
    assert f["stage_calls"]["count"] == f["staged"] + f["fallbacks"]["count"]
    assert f["sent"] == {"side": {"calls": f["stage_calls"]["count"], "bytes": f["staged"] * MIB,
                                  "seconds": pytest.approx(0.5 * f["staged"]), "gib_s": 2 / 1024}}
    # The line gives a send's time a call, not a speed: it includes the call's wait on the trainer.
    assert (f"sent {f['staged']} x 1.0 MiB by side channel, 0.500 s a call;"
            in lines.orchestrator_line(f))
  assert figures[0]["step_s"] is None and figures[1]["step_s"] > 0
  assert [r["step"] for r in tel.history["orchestrator"]] == [0, 1]


def test_the_orchestrator_counts_fallbacks_by_their_typed_status():
  """By each fallback's status, never by its text: a reason may say anything (here, another
  kind's word before a colon), and the line and the bench still read it as written."""
  reasons = [Fallback(StageStatus.REFUSED, "device bound reached"),
             Fallback(StageStatus.UNPLACED, "failed: the slot wait ran out"),
             Fallback(StageStatus.REFUSED, "unsupported: not here"),
             Fallback(StageStatus.FAILED, "LostReply")]
  tel = process.Telemetry(process.Settings(host="tunix", log_every=0))
  figures = tel.orchestrator_step(StepReport(0, trained=4, inline=4, fallbacks=4,
                                             fallback_reasons=reasons), 2)
  assert figures["fallbacks"] == {"count": 4,
                                  "by_kind": {"refused": 2, "failed": 1, "unplaced": 1}}
  assert list(figures["fallbacks"]["by_kind"]) == ["refused", "failed", "unplaced"]
  assert reasons[1] == "unplaced: failed: the slot wait ran out"
  assert json.loads(json.dumps(reasons)) == [str(r) for r in reasons]


def test_the_settings_a_record_carries_come_from_the_settings_table():
  """One list (record.CARRIED) of the table's settings: what a process's records carry (each
  role's own), the types a reader accepts (a depth or bound sized each step may say auto), and
  the defaults the report takes where a record lacks one."""
  cfg = config_lib.resolve({"mode": "stage", "max_staged_batches": 2, "max_host_batches": 3},
                           env={})
  settings = process.Settings.of("tunix", cfg)
  assert dict(settings.shaping) == {"max_staged_batches": 2, "max_device_batches": 1,
                                    "max_host_batches": 3, "codec": "off"}
  assert records_lib.SHAPES["common"]["settings"] == {
      "?max_staged_batches": records_lib.SIZED, "?max_device_batches": records_lib.COUNT,
      "?max_host_batches": records_lib.SIZED, "?codec": records_lib.TEXT}
  tel = process.Telemetry(dataclasses.replace(settings, log_every=0))
  tel.trainer()
  for span in (compute("fwd_bwd", 0.0, 1.0), compute("update", 1.0, 1.1)):
    tel.recorder.add(span.track, span.name, span.start, span.end, **dict(span.args))
  tel.orchestrator_step(StepReport(0, trained=1, inline=1), 2)
  assert tel.history["trainer"][0]["settings"] == {"max_device_batches": 1,
                                                   "max_host_batches": 3}
  assert tel.history["orchestrator"][0]["settings"] == {"max_staged_batches": 2, "codec": "off"}
  row = {"max_host_batches": float("nan"), "max_staged_batches": float("nan")}
  # A record that lacks a sized setting ran at its fixed value (the default before auto was).
  assert runs_lib.setting(row, "max_host_batches") == \
      config_lib.SETTINGS_BY_FIELD["max_host_batches"].fixed == 1
  assert runs_lib.setting(row, "max_staged_batches") == 2
  assert runs_lib.setting({"max_host_batches": 3.0}, "max_host_batches") == 3


def test_records_are_written_one_line_per_step_and_read_back(tmp_path):
  tel = process.Telemetry(process.Settings(host="test", metrics_dir=str(tmp_path / "m"),
                                           log_every=0, shaping=(("max_host_batches", 1),)))
  tel.trainer()  # this process trains: its aggregator listens
  for span in (compute("fwd_bwd", 0.0, 1.0), compute("update", 1.0, 1.1),
               compute("fwd_bwd", 1.2, 2.0), compute("update", 2.0, 2.1)):
    tel.recorder.add(span.track, span.name, span.start, span.end, **dict(span.args))
  ((path, _),) = records_lib.files([str(tmp_path / "m")])
  assert os.path.basename(path) == record_lib.file_name("trainer", tel.run["id"])
  found = records_lib.read([path])
  steps = found.steps["trainer"]
  assert found.notes == [] and steps["step"].tolist() == [0, 1]
  assert steps["input_wait_boundary_s"][1] == pytest.approx(0.1)
  assert steps["max_host_batches"].tolist() == [1, 1] and steps["host"].tolist() == ["test"] * 2
  assert steps["max_staged_batches"].isna().all()  # not a trainer's setting: not carried
  # A last line cut short (a process killed while writing it, or still writing it, as here):
  # the whole records before it are read.
  written = [json.loads(line) for line in open(path, encoding="utf-8")]
  with open(path, "a", encoding="utf-8") as f:
    f.write(json.dumps(written[0])[:40])
  again = records_lib.read([path])
  assert len(again.steps["trainer"]) == 2
  (note,) = again.notes
  assert "its last line is still being written" in note
  # A record written before the metrics logger has no host_step: still read, as it was.
  old = tmp_path / "old.jsonl"
  old.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "host_step"}) + "\n"
                         for r in written), encoding="utf-8")
  assert all("host_step" in r for r in written)
  read_old = records_lib.read([str(old)])
  assert read_old.notes == [] and read_old.steps["trainer"]["step"].tolist() == [0, 1]
  assert read_old.steps["trainer"]["host_step"].isna().all()
  tel.close()


@pytest.mark.parametrize("line, message", [
    ('{"schema": "tunix-stage-metrics", "version": 9}', "schema version 9 is not one this"),
    ('{"schema": "other"}', "not a tunix-stage-metrics record"),
    ('not json', "not a JSON record"),
    ('{"schema": "tunix-stage-metrics", "version": 1, "role": "trainer"}', "a trainer record "
     "without"),
])
def test_a_record_file_that_is_not_this_schema_is_refused_in_one_line(tmp_path, line, message):
  path = tmp_path / "x.jsonl"
  path.write_text(line + "\n" + line + "\n")
  with pytest.raises(records_lib.RecordError, match=message) as e:
    records_lib.read([str(path)])
  assert str(e.value).startswith(f"{path}:1 is invalid: ") and "\n" not in str(e.value)


def test_an_unwritable_record_is_said_once_and_the_job_goes_on(tmp_path, capsys):
  blocker = tmp_path / "file"
  blocker.write_text("")
  writer = record_lib.Writer(str(blocker / "metrics"), "trainer", "r1")  # a folder under a file
  for step in range(3):
    writer.write({"step": step})
  (line,) = capsys.readouterr().err.strip().splitlines()
  assert line.startswith(f"tunix-stage: metrics: cannot write {writer.path} (") and line.endswith(
      "the job goes on without its metrics record")


@pytest.mark.parametrize("every, said", [(1, [0, 1, 2, 3]), (2, [0, 2]), (0, [])])
def test_the_per_step_line_is_said_every_n_steps(capsys, every, said):
  for step in range(4):
    lines.say(step, every, f"line {step}")
  assert capsys.readouterr().err.splitlines() == [f"line {s}" for s in said]


def test_the_step_s_scalars_are_named_under_stage_from_the_one_table():
  """Each trainer step's figures as named scalars (a trainer's own metrics logger logs them):
  every name under `stage/`, read from the figures the aggregator made; an unknown figure (the
  first step's boundary wait, a slowdown without a baseline) is left out, not logged as 0."""
  steps = []
  agg = recorder_lib.TrainerSteps(steps.append, peaks=lambda: (2, 1))
  for span in (compute("fwd_bwd", 0.0, 1.0), compute("update", 1.0, 1.2, host_step=7),
               Span(tracks.TRAINER_RECEIVE, "stage_batch", 1.2, 1.7,
                    (("bytes", 1 << 30), ("transport", "side"))),
               Span(tracks.TRAINER_H2D, "s1-m0", 1.7, 1.8, (("bytes", 8), ("lane", "staging"))),
               compute("fwd_bwd", 2.0, 3.0), compute("update", 3.0, 3.2, host_step=8)):
    agg.record(span)
  first, second = steps
  assert (first["host_step"], second["host_step"]) == (7, 8)  # what each update answered
  named = figures_lib.scalars(figures_lib.TRAINER, second)
  assert all(name.startswith(figures_lib.PREFIX) for name in named)
  assert set(named) == {figures_lib.PREFIX + f.name for f in figures_lib.FIGURES
                        if f.role == figures_lib.TRAINER and f.scalar}
  assert named["stage/input_wait_boundary_s"] == pytest.approx(0.8)
  assert named["stage/received_gib_s"] == pytest.approx(1 / 0.5)
  assert named["stage/placed_staged"] == 1 and named["stage/placed_inline"] == 0
  assert named["stage/peak_device_batches"] == 2
  assert named["stage/bound_by_wire"] == 1
  assert named["stage/bound_by_compute"] == named["stage/bound_by_shared_cores"] == 0
  assert "stage/input_wait_boundary_s" not in figures_lib.scalars(figures_lib.TRAINER, first)
  # nothing received in it
  assert "stage/received_gib_s" not in figures_lib.scalars(figures_lib.TRAINER, first)
  assert all(type(v) in (int, float) for v in named.values())  # plain numbers, for any logger


def test_a_step_sink_that_raises_is_said_once_and_dropped_and_the_record_goes_on(
    tmp_path, caplog):
  tel = process.Telemetry(process.Settings(host="test", metrics_dir=str(tmp_path / "m"),
                                           log_every=0))
  tel.trainer()
  told = []

  class Logger:  # a step sink, as a trainer's metrics logger gets one
    def step(self, figures):
      told.append(figures["host_step"])

  class Broken:
    def step(self, figures):
      raise OSError("disk full")

  tel.add_step_sink(Broken())
  tel.add_step_sink(Logger())
  with caplog.at_level(logging.WARNING, logger="tunix_stage_plugin"):
    for n in range(3):
      for span in (compute("fwd_bwd", 2.0 * n, 2.0 * n + 1.0),
                   compute("update", 2.0 * n + 1.0, 2.0 * n + 1.1, host_step=n + 1)):
        tel.recorder.add(span.track, span.name, span.start, span.end, **dict(span.args))
  assert told == [1, 2, 3]
  assert [r.message for r in caplog.records] == [
      "tunix-stage: telemetry: Broken failed (OSError: disk full) and was dropped; staging goes on"]
  steps = records_lib.read([str(tmp_path / "m")]).steps["trainer"]
  assert steps["host_step"].tolist() == [1, 2, 3]  # the record carries the host's step
  tel.close()
  tel.trainer().record(compute("fwd_bwd", 9.0, 9.5))  # closed: no sink is told any more
  tel.trainer().record(compute("update", 9.5, 9.6, host_step=4))
  assert told == [1, 2, 3]
  tel.close()


def test_the_orchestrator_s_scalars_and_host_step_reach_its_own_sinks_and_record(tmp_path):
  """An orchestrator step's figures carry the trainer's step its last update answered (where
  the host's answer carries one), its record says it, and they go to the orchestrator's step
  sinks as `stage/...` scalars from the one table (StepReport's own names among them); the
  trainer's sinks are not told of them."""
  tel = process.Telemetry(process.Settings(host="tunix", metrics_dir=str(tmp_path / "m"),
                                           log_every=0))
  told = {"trainer": [], "orchestrator": []}

  class Sink:
    def __init__(self, role):
      self.role = role

    def step(self, figures):
      told[self.role].append(figures)

  tel.add_step_sink(Sink("trainer"))
  tel.add_step_sink(Sink("orchestrator"), record_lib.ORCHESTRATOR)
  report = StepReport(0, trained=4, staged=3, inline=1, fallbacks=1, prestaged=1, peak_staged=2,
                      fallback_reasons=[Fallback(StageStatus.REFUSED, "device bound reached")])
  tel.orchestrator_step(report, 2, host_step=5)
  tel.orchestrator_step(StepReport(1, trained=4, staged=4), 2)  # the answer carried no step
  assert told["trainer"] == [] and [f["host_step"] for f in told["orchestrator"]] == [5, None]
  named = figures_lib.scalars(figures_lib.ORCHESTRATOR, told["orchestrator"][0])
  assert set(report.metrics()) <= set(named)  # tunix's step result's names are the same
  assert {k: named[k] for k in report.metrics()} == report.metrics()
  assert named["stage/fallbacks_refused"] == 1 and named["stage/fallbacks_failed"] == 0
  assert named["stage/depth"] == 2 and "stage/step_s" not in named  # the first: unknown
  assert set(figures_lib.scalars(figures_lib.ORCHESTRATOR, told["orchestrator"][1])) == {
      figures_lib.PREFIX + f.name for f in figures_lib.FIGURES
      if f.role == figures_lib.ORCHESTRATOR and f.scalar} - {"stage/stage_call_median_s"}
  steps = records_lib.read([str(tmp_path / "m")]).steps["orchestrator"]
  assert steps["host_step"].tolist()[0] == 5 and math.isnan(steps["host_step"].tolist()[1])
  tel.close()
