"""What staging did in a real two-process tunix job, said by the job itself (docs/observability.md).

A trainer node of tunix's own GrpcRemoteExecutionServer, TrainerWorker and PeftTrainer (test_grpc's
node, one worker; its PeftTrainer given a tunix PerfTracer) with the plugin installed and a
metrics folder; this process is the orchestrator. The same job of 64 MiB micro-batches runs
staged (the orchestrator's plugin installed, writing its own record there too) and then inline
(nothing of the plugin in this process: tunix's own calls). Each process writes one record per
step; the staged steps' input wait is a small share of the inline ones' (whose is the host path's
cost: tunix's unary call of each micro-batch); `tunix-stage report` prints the per-step tables
and a recommendation; the trainer's PerfTracer exports, through tunix's own Perfetto writer, the
plugin's spans next to `peft_train`.
"""

from __future__ import annotations

import json
import statistics
import struct
import threading
import time
import types

import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

import jax  # pylint: disable=wrong-import-position

from tests.cli.test_report import report  # pylint: disable=wrong-import-position
from tests.hosts.tunix import test_grpc  # pylint: disable=wrong-import-position
from tests.records import job_records  # pylint: disable=wrong-import-position
from tunix_stage_plugin import reading  # pylint: disable=wrong-import-position
from tunix_stage_plugin.core.telemetry import figures as figures_lib  # pylint: disable=wrong-import-position
from tunix_stage_plugin.core.telemetry import record as record_lib  # pylint: disable=wrong-import-position
from tunix_stage_plugin.reading import records as records_lib  # pylint: disable=wrong-import-position

pytestmark = pytest.mark.tunix
MIB = 1 << 20
# Each role's scalars by their full names (figures.FIGURES' `scalar`).
SCALARS = {role: {figures_lib.PREFIX + f.name for f in figures_lib.FIGURES
                  if f.role == role and f.scalar} for role in figures_lib.ROLES}


def payloads():
  """STEPS x MICRO micro-batches of 64 MiB (routed-expert ids the loss reads, so the compute
  takes longer than the side channel's transfer and less than tunix's unary call)."""
  out = [test_grpc.batch(n, 512, 512, 8) for n in range(test_grpc.STEPS * test_grpc.MICRO)]
  assert {p["experts"].nbytes for p in out} == {64 * MIB}
  return out


def test_a_job_records_its_steps_and_report_reads_them(tmp_path):
  folder = tmp_path / "metrics"
  proc, ports = test_grpc._start_node("observed", **{test_grpc.NODE_METRICS: str(folder)})  # pylint: disable=protected-access
  try:
    port = ports["observed"]
    job = payloads()
    test_grpc.run_program(port, staged=True, payloads=job, settings={"metrics": str(folder)})
    test_grpc.run_program(port, staged=False, payloads=job)
    span_names, files = test_grpc.ask_node(port, "perf_spans")
  finally:
    test_grpc._stop_node(proc)  # pylint: disable=protected-access
  by_role = job_records(folder)
  trainer, orchestrator = by_role["trainer"], by_role["orchestrator"]
  # One record per step and process: the trainer's 2 staged steps and 2 inline ones; the
  # orchestrator's 2 staged (the inline job ran without the plugin in this process).
  assert [r["step"] for r in trainer] == [0, 1, 2, 3]
  assert [r["step"] for r in orchestrator] == [0, 1]
  assert all(r["microbatches"] == test_grpc.MICRO for r in trainer + orchestrator)
  assert sum(r["staged"] for r in orchestrator) >= test_grpc.MICRO
  assert orchestrator[1]["sent"]["side"]["bytes"] >= 3 * 64 * MIB
  staged_wait = [figures_lib.row("trainer", r)["input_wait_s"] for r in trainer[1:2]]
  inline_wait = [figures_lib.row("trainer", r)["input_wait_s"] for r in trainer[3:4]]
  print(f"\ninput wait per step: staged {staged_wait}, inline {inline_wait}; trainer records "
        f"{[(r['bound_by'], r['receive']['by_transport']) for r in trainer]}")
  assert inline_wait[0] > 2 * staged_wait[0] + 0.05, (staged_wait, inline_wait)
  # Every micro-batch of the staged job arrived over the side channel, each counted in the step
  # it arrived in (a prestaged one in the step before its own).
  assert sum(r["receive"]["by_transport"]["side"]["calls"] for r in trainer[:2]) == \
      test_grpc.STEPS * test_grpc.MICRO
  assert trainer[3]["place"]["inline"] == test_grpc.MICRO  # inline: each placed in its call
  # tunix's own export of the trainer's PerfTracer holds the plugin's spans beside peft_train.
  assert {"peft_train", "stage_receive", "stage_place"} <= set(span_names), span_names
  assert any(f.startswith("perfetto_trace_v2_") for f in files), files

  out = report(str(folder)).stdout
  print(out)  # with -s: what a user's `tunix-stage report` says of this job
  # Two jobs: the staged one (its trainer steps beside its orchestrator's) and the inline one,
  # whose orchestrator ran without the plugin (the trainer's steps alone): never one median.
  assert out.startswith("2 runs (jobs) in these records, each reported apart"), out
  first, second = out.split("\nrun 2 of 2: ")
  assert "trainer " in first and "orchestrator " in first and first.count("(tunix, 2 steps)") == 2
  # (its processes are named before its overall lines, which may say what the orchestrator did)
  listed = second.split("\noverall (")[0]
  assert "trainer " in listed and "orchestrator " not in listed and "(tunix, 2 steps)" in second
  assert "wait boundary" in out and "staging hid" in out
  assert all(part.splitlines()[-1].startswith("recommendation: ") for part in (first, second))
  # Was staging worth it: the staged run says what staging hid; the inline one that it did not
  # stage, which process and why, the setting that turns it on and the simulator's prediction.
  assert "staging hid" in first and "did not stage" not in first
  (said,) = [line.strip() for line in second.splitlines()
             if line.strip().startswith("did not stage: ")]
  trainer_name = f"{trainer[0]['process']['hostname']}:{trainer[0]['process']['pid']}"
  assert said.startswith("did not stage: the orchestrator sent every micro-batch with its train "
                         "call (staging off on it, or no plugin there: it wrote no record), and "
                         f"trainer {trainer_name} placed all "
                         f"{test_grpc.STEPS * test_grpc.MICRO} inline; turned on by "
                         "TUNIX_STAGE_BATCH=stage on the orchestrator: at the default, simulate "
                         "predicts "), said
  assert "staging hid" not in second
  assert "checked by simulate: its replay of the record as inline takes " in second
  assert second.splitlines()[-1].startswith("recommendation: TUNIX_STAGE_BATCH=stage on the "
                                            "orchestrator: turns staging on")


def test_report_says_a_trainer_without_the_plugin_refused_staging(tmp_path):
  """This process's orchestrator stages (the plugin installed here, writing its record) against a
  trainer node without the plugin: tunix's worker has no stage_batch, so it answers the first
  stage unsupported and every micro-batch trains inline; the trainer writes no record. `report`
  says which process refused, why, and what turns staging on; nothing replays it."""
  folder = tmp_path / "metrics"
  proc, ports = test_grpc._start_node("plain")  # pylint: disable=protected-access
  try:
    _, _, reports = test_grpc.run_program(ports["plain"], staged=True,
                                          settings={"metrics": str(folder)})
  finally:
    test_grpc._stop_node(proc)  # pylint: disable=protected-access
  assert [r.stage_metrics["stage/staged"] for r in reports] == [0] * test_grpc.STEPS
  by_role = job_records(folder)
  assert by_role["trainer"] == [] and len(by_role["orchestrator"]) == test_grpc.STEPS
  orchestrator = by_role["orchestrator"][0]["process"]
  run = json.loads(report(str(folder), "--json").stdout)["runs"][0]["summary"]
  assert run["orchestrator"]["fallbacks_by_kind"] == {"unsupported": 1}
  assert run["staging"] == {
      "staged": False, "role": "trainer",
      "turn_on": "TUNIX_STAGE_BATCH=stage on the trainer, with the plugin installed there",
      "said": f"the trainer refused orchestrator {orchestrator['hostname']}:{orchestrator['pid']}"
              "'s stages as unsupported (staging is off on the trainer, or it runs without the "
              f"plugin), so all {test_grpc.STEPS * test_grpc.MICRO} micro-batches trained inline"}
  out = report(str(folder)).stdout
  print(out)  # with -s: what a user's `tunix-stage report` says of this job
  assert f"  did not stage: {run['staging']['said']}; turned on by " in out
  assert "staging hid" not in out and "nothing to change" not in out
  assert out.splitlines()[-1] == f"recommendation: {run['recommendations'][0]}"
  assert out.splitlines()[-1].startswith("recommendation: TUNIX_STAGE_BATCH=stage on the trainer")


def test_the_peft_train_device_span_ends_on_the_watcher_s_one_wait():
  """With a PerfTracer, each computation is waited for once: the plugin's watcher ends tunix's
  device span of `peft_train` after its own wait; no thread of tunix's waits for the output."""
  # pylint: disable=import-outside-toplevel
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh
  from tunix.perf.experimental import tracer as perf_tracer

  from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
  from tunix_stage_plugin.core.telemetry import recorder as trainer_lib
  from tunix_stage_plugin.hosts.tunix import peft as tracing

  tracer = perf_tracer.PerfTracer(devices=jax.devices(), export_fn=lambda timelines: timelines)
  mesh = Mesh(np.array(jax.devices()).reshape(-1, 1), ("fsdp", "tp"))
  waits = []
  watcher = trainer_lib.ComputeWatcher(recorder_lib.Recorder(), lambda out: waits.append(
      jax.block_until_ready(out)))
  work = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((256, 256))
  work(x).block_until_ready()  # compiled
  threads = threading.active_count()
  start = time.perf_counter()
  with tracing.computation(tracer, types.SimpleNamespace(_train_steps=3), mesh) as ended:
    out = work(x)
  assert threading.active_count() == threads  # tunix started no thread to wait for it
  watcher.dispatched("fwd_bwd", start, time.perf_counter(), out, on_ready=ended)
  assert watcher.drain(30)
  assert len(waits) == 1
  timelines = tracer.export()
  spans = {tid: [s for step in tl.all_steps for s in step.values()]
           for tid, tl in timelines.items()}
  device = {tid: found for tid, found in spans.items() if found and not tid.startswith("host")}
  (only,) = device.values()  # the mesh's first device, as tunix's tracer.span picks it
  (span,) = only
  assert span.name == "peft_train" and span.tags["step"] == 3
  assert start <= span.begin <= span.end
  host = [s for tid, found in spans.items() if tid.startswith("host") for s in found]
  assert [s.name for s in host] == ["peft_train"]
  watcher.close()


def tensorboard_scalars(folder):
  """{tag: [(step, value)]} of every TensorBoard event file under `folder`, read back from the
  files' TFRecord framing (length, its CRC, the Event, its CRC) with tensorboardX's Event proto."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  scalars = {}
  files = sorted(p for p in folder.rglob("*") if "tfevents" in p.name)
  assert files, f"no TensorBoard event file under {folder}"
  for path in files:
    data, at = path.read_bytes(), 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
      at += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_the_stage_figures_sit_beside_the_loss_in_the_trainer_s_tensorboard(tmp_path):
  """A trainer node whose PeftTrainer has a MetricsLogger writing TensorBoard files: staged, the
  files hold `train/stage/...` at the steps of the trainer's own `train/loss`; a node without
  the plugin (staging off) writes its loss and no `stage/` tag."""
  on, off = tmp_path / "on", tmp_path / "off"
  nodes = [test_grpc._start_node("observed", **{test_grpc.NODE_METRICS: str(tmp_path / "m"),  # pylint: disable=protected-access
                                                test_grpc.NODE_TENSORBOARD: str(on)}),
           test_grpc._start_node("bare", **{test_grpc.NODE_TENSORBOARD: str(off)})]  # pylint: disable=protected-access
  heard = []  # what this process (the orchestrator) tells its jax.monitoring listeners

  def listen(event, value, **kwargs):
    heard.append((event, value, kwargs.get("step")))

  jax.monitoring.register_scalar_listener(listen)
  try:
    (port_on,), (port_off,) = (ports.values() for _, ports in nodes)
    test_grpc.run_program(port_on, staged=True)
    staged_heard = list(heard)
    test_grpc.run_program(port_off, staged=False)
    for port in (port_on, port_off):
      test_grpc.ask_node(port, "close_trainer")
  finally:
    jax.monitoring.unregister_scalar_listener(listen)
    for proc, _ in nodes:
      test_grpc._stop_node(proc)  # pylint: disable=protected-access
  staged = tensorboard_scalars(on)
  loss_steps = [step for step, _ in staged["train/loss"]]
  assert loss_steps == list(range(1, test_grpc.STEPS + 1)), staged["train/loss"]
  stage = {tag: points for tag, points in staged.items() if tag.startswith("train/stage/")}
  print(f"\nstaged TensorBoard tags: {sorted(staged)}")
  always = ("compute_s", "input_wait_mid_step_s", "other_s", "placed_staged", "placed_inline",
            "pool_waits", "bound_by_compute", "bound_by_wire", "bound_by_shared_cores")
  for name in always:  # known every step: at every step of the loss, once
    assert [step for step, _ in stage[f"train/stage/{name}"]] == loss_steps, (name, stage)
  assert {tag.removeprefix("train/") for tag in stage} <= SCALARS[figures_lib.TRAINER]
  assert all(step in loss_steps for points in stage.values() for step, _ in points)
  assert sum(v for _, v in stage["train/stage/placed_staged"]) >= test_grpc.MICRO  # it staged
  assert all(v > 0 for _, v in stage["train/stage/compute_s"])
  # What staging saved sits beside the loss at each step that staged, as the trainer's record
  # holds it; the report's "staging hid" is its median over the judged steps that staged.
  rows = reading.steps(str(tmp_path / "m"))
  rows = rows[rows["role"] == figures_lib.TRAINER]
  saved = [(int(step), value) for step, value in zip(rows["host_step"], rows["saved_s"])
           if value == value]
  assert saved, rows[["host_step", "placed_staged", "saved_s"]]
  assert [step for step, _ in stage["train/stage/saved_s"]] == [step for step, _ in saved]
  assert [v for _, v in stage["train/stage/saved_s"]] == pytest.approx(  # TensorBoard's float32
      [value for _, value in saved], rel=1e-6)
  (run,) = json.loads(report("--json", str(tmp_path / "m")).stdout)["runs"]
  judged = rows["step_s"].notna() & (rows["placed_staged"] > 0)
  assert run["summary"]["trainer"]["hidden_s"] == pytest.approx(
      statistics.median(rows["saved_s"][judged]))
  plain = tensorboard_scalars(off)
  assert [step for step, _ in plain["train/loss"]] == loss_steps
  assert not [tag for tag in plain if "stage/" in tag], sorted(plain)
  # The orchestrator's figures reached this process's jax.monitoring listeners at the steps of
  # the trainer's loss (tunix's train_step, from each step's last update answer); with staging
  # off in this process nothing was said.
  mine = [(event, value, step) for event, value, step in staged_heard
          if event.startswith(figures_lib.PREFIX)]
  assert {event for event, _, _ in mine} <= SCALARS[figures_lib.ORCHESTRATOR]
  assert [step for event, _, step in mine if event == "stage/staged"] == loss_steps
  assert [v for event, v, _ in mine if event == "stage/microbatches"] == \
      [test_grpc.MICRO] * test_grpc.STEPS
  assert sum(v for event, v, _ in mine if event == "stage/staged") >= test_grpc.MICRO
  assert not [e for e in heard[len(staged_heard):] if e[0].startswith(figures_lib.PREFIX)]


def run_pair(tmp_path, steps=6):
  """Two runs of the real two-process job, each a trainer node of its own writing to its own
  folder, with this process's orchestrator records beside: TUNIX_STAGE_MAX_HOST_BATCHES 1 and
  2 on the trainer."""
  folders = [tmp_path / "bound1", tmp_path / "bound2"]
  nodes = [test_grpc._start_node("observed", **{test_grpc.NODE_METRICS: str(folder),  # pylint: disable=protected-access
                                                "TUNIX_STAGE_MAX_HOST_BATCHES": str(bound)})
           for bound, folder in zip((1, 2), folders)]
  try:
    for (_, ports), folder in zip(nodes, folders):
      job = [test_grpc.batch(n) for n in range(steps * test_grpc.MICRO)]
      test_grpc.run_program(ports["observed"], staged=True, payloads=job, steps=steps,
                            settings={"metrics": str(folder)})
  finally:
    for proc, _ in nodes:
      test_grpc._stop_node(proc)  # pylint: disable=protected-access
  return [str(folder) for folder in folders]


def test_report_compares_two_real_runs_and_draws_them(tmp_path):
  """`report A B` on two runs of the real job (host bounds 1 and 2): each figure's median, the
  change and a verdict from both runs' 5 judged steps; `--png` draws them side by side (the
  picture read back); what `report` refuses it still refuses."""
  from tunix_stage_plugin.reading import compare as report_compare  # pylint: disable=import-outside-toplevel
  a, b = run_pair(tmp_path)
  for folder, bound in ((a, 1), (b, 2)):
    trainer = records_lib.read([folder]).steps[record_lib.TRAINER]
    assert set(trainer["max_host_batches"]) == {bound}

  data = json.loads(report(a, b, "--json").stdout)
  assert [(r["label"], r["trainer_steps"], r["orchestrator_steps"]) for r in data["runs"]] == \
      [(a, 6, 6), (b, 6, 6)]
  figures = {f["name"]: f for f in data["figures"]}
  assert {f["side"] for f in data["figures"]} == {"trainer", "orchestrator"}
  for name in ("stage/step_s", "stage/compute_s", "stage/input_wait_s", "stage/staged"):
    f = figures[name]
    assert f["steps"] == [5, 5] and f["verdict"] in (report_compare.BEYOND,
                                                      report_compare.WITHIN), f
    assert f["change"] == pytest.approx(f["b"] - f["a"])
  assert figures["stage/microbatches"]["a"] == figures["stage/microbatches"]["b"] == \
      test_grpc.MICRO
  out = report(a, b).stdout
  print(out)  # with -s: what a user's `tunix-stage report A B` says of these two runs
  assert f"A: {a} (6 trainer steps, 6 orchestrator steps)" in out
  assert f"noise: {report_compare.TEST}" in out

  two, one = tmp_path / "two.png", tmp_path / "one.png"
  report(a, b, "--png", str(two))
  report(a, "--png", str(one))
  image = pytest.importorskip("matplotlib.image")
  pictures = [image.imread(str(p)) for p in (one, two)]
  assert pictures[0].shape[0] == pictures[1].shape[0] and \
      pictures[1].shape[1] > pictures[0].shape[1]  # two panels side by side
  for pic in pictures:
    h, w = pic.shape[:2]
    area = pic[h // 4:3 * h // 4, w // 10:w * 19 // 20, :3]
    assert len({tuple(px) for px in (area.reshape(-1, 3) * 255).astype(int).tolist()}) > 1

  bad = report(a, str(tmp_path / "missing.jsonl"), check=False)
  assert bad.returncode == 2 and bad.stdout == "" and \
      bad.stderr.startswith("tunix-stage report: error: ") and "no such file" in bad.stderr
  bad = report(a, b, "--png", str(tmp_path), check=False)
  assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and \
      "--png=" in bad.stderr
