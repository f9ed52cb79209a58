"""`tunix-stage bench --host tunix`: the A/B on real tunix processes (lab/tunix).

Every test starts real trainer node processes (tunix's GrpcRemoteExecutionServer, TrainerWorker
and PeftTrainer on a 2-device CPU mesh) and drives them with tunix's DistributedRLEngine and
StandardRLProgram from this process. --tiny runs: their step times mean nothing, so only the
structure and the correctness checks are asserted (timing claims live in the bench's figures,
docs/bench.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("tunix.experimental.orchestrator.rl_program",
                    reason="tunix's experimental stack (google/tunix main) is not importable")

# pylint: disable=wrong-import-position
from tests import procs
from tunix_stage_plugin.activation import manager
from tunix_stage_plugin.core.telemetry import recorder as recorder_lib
from tunix_stage_plugin.core import tracks
from tunix_stage_plugin.lab.bench import host as host_lib
from tunix_stage_plugin.lab.bench import results
from tunix_stage_plugin.lab.embedded import data as data_lib
from tunix_stage_plugin.lab.tunix import bench as tunix_bench

pytestmark = pytest.mark.tunix
NODE = b"tunix_stage_plugin.lab.tunix.node"  # a trainer node's command line

CORRECTNESS = ("same param_digest in every mode and round",
               "expected trained_order in every mode and round",
               "peak staged device batches <= bound")


def _bench(tmp_path, *args, timeout=600):
  out = tmp_path / "out"
  done = subprocess.run(
      [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--host", "tunix", "--tiny",
       "--quick", "--steps", "1", "--microbatches", "2", "--out", str(out), *args],
      capture_output=True, text=True, timeout=timeout)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return out, json.loads((out / "bench.json").read_text()), done


def test_every_mode_on_tunix_trains_the_same_parameters_in_order(tmp_path):
  out, report, done = _bench(tmp_path)
  assert report["options"]["host"] == "tunix"
  assert "tunix-stage bench on the tunix host" in done.stdout
  calibration = report["calibration"]
  assert calibration["wire_bytes_per_s"] is None and calibration["h2d"] == "real"
  assert calibration["sync_s"] == 0.0
  verdicts = {c["name"]: c["passed"] for c in report["criteria"]}
  assert all(verdicts[name] is True for name in CORRECTNESS), verdicts
  assert {r["mode"] for r in report["runs"]} == {"inline", "depth1", "depth2", "depth2_prestage",
                                                 "resident"}
  modes = report["modes"]
  # Staged modes staged (the trainer's store held a batch) without falling back; inline and
  # resident held none.
  for mode in ("depth1", "depth2", "depth2_prestage"):
    assert modes[mode]["peak_device_batches"] >= 1 and modes[mode]["fallbacks"] == 0, mode
    assert modes[mode]["host_path"]["path"] == "staged"
  assert modes["inline"]["peak_device_batches"] == 0
  assert modes["inline"]["host_path"]["path"] == "inline"
  assert calibration["wire_s"] > 0  # the measured receive, what `simulate` reads
  # The plugin's node's own per-step records agree with the bench's measurement of the same
  # steps (the staged modes ran there; inline and resident on tunix's own node have none).
  _assert_job_side_agrees(report, {"depth1", "depth2", "depth2_prestage"})
  assert (out / "trace.json").exists() and (out / "timeline.png").exists()

  # The same JSON through the host-agnostic tools: simulate's check and --compare.
  check = subprocess.run(
      [sys.executable, "-m", "tunix_stage_plugin.cli.main", "simulate", "--check",
       str(out / "bench.json"), "--json", "-"], capture_output=True, text=True, timeout=120)
  assert check.returncode == 0, check.stderr
  assert set(json.loads(check.stdout)["modes"]) == set(modes)
  compare = subprocess.run(
      [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--compare",
       str(out / "bench.json"), str(out / "bench.json")], capture_output=True, text=True,
      timeout=120)
  assert compare.returncode == 0, compare.stderr
  assert "depth2_prestage" in compare.stdout


def test_inline_runs_with_nothing_of_the_plugin_installed_on_either_side():
  """The inline mode is tunix byte for byte: the node it runs on reports no plugin (checked when
  the host connects), and in this process nothing is installed while tunix's loop runs it; a
  staged mode installs the plugin here for its run only."""
  options = results.BenchOptions(host="tunix", tiny=True, microbatches=2, steps=1)
  host = host_lib.load(options)
  seen: dict[str, list[bool]] = {"inline": [], "depth2_prestage": []}

  async def main():
    await host.open()
    try:
      make = data_lib.BatchMaker(options.sizes(), options.seed)
      for mode, installed in seen.items():
        node = host.nodes[host.node_for(mode)]
        await node.handle.asubmit("bench_setup")
        await host._job(node, mode, 2, make,  # pylint: disable=protected-access
                        on_step=lambda installed=installed: installed.append(
                            manager.is_installed()))
    finally:
      await host.close()

  host.start(lambda _: None)
  try:
    assert host.info == {}  # filled in by open()
    asyncio.run(main())
  finally:
    assert host.stop() == 0
  assert host.info[tunix_bench.PLAIN]["plugin"] is False
  assert host.info[tunix_bench.PLUGIN]["plugin"] is True
  assert seen == {"inline": [False, False], "depth2_prestage": [True, True]}
  assert not manager.is_installed()


def test_over_tunix_message_cap_inline_takes_the_plugins_path_and_trains_the_same(tmp_path):
  """160 MiB micro-batches (over tunix's 128 MiB cap): tunix's unary call cannot carry them, so
  inline runs on the plugin's node staging nothing, and every mode still trains the same
  parameters."""
  options = results.BenchOptions(host="tunix", tiny=True, payload_mib=160)
  host = tunix_bench.BenchHost(options)
  assert host.over_cap(options.sizes())
  assert host.node_for("inline") == tunix_bench.PLUGIN
  assert host.node_for("resident") == tunix_bench.PLAIN
  _, report, _ = _bench(tmp_path, "--payload_mib", "160", "--modes",
                        "inline,depth2_prestage,resident")
  verdicts = {c["name"]: c["passed"] for c in report["criteria"]}
  assert all(verdicts[name] is True for name in CORRECTNESS), verdicts
  assert report["modes"]["inline"]["peak_device_batches"] == 0  # nothing staged
  assert report["modes"]["inline"]["host_path"]["path"] == "inline"
  # Here inline ran on the plugin's node too: its records show the host path's cost.
  _assert_job_side_agrees(report, {"inline", "depth2_prestage"})


def _assert_job_side_agrees(report, modes_with_records):
  """The trainer's records (what a job writes) agree with the bench's own figures, step by
  step, in every run that has them, and exactly the runs on the plugin's node have them."""
  (check,) = [c for c in report["criteria"] if c["name"].startswith("job-side")]
  assert check["passed"] is True and check["value"] == 0, check
  with_records = {r["mode"] for r in report["runs"] if r["job_side"] is not None}
  assert with_records == modes_with_records
  for run in report["runs"]:
    for step in run["job_side"] or ():
      assert step["agrees"], (run["mode"], step)


def test_ctrl_c_stops_both_nodes_and_writes_the_runs_so_far(tmp_path):
  """SIGINT to the whole process group (as a terminal's Ctrl-C) while a mode run is going: the
  bench exits 130 with the finished runs in its JSON, and neither node process is left."""
  out = tmp_path / "out"
  proc = subprocess.Popen(
      [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--host", "tunix", "--tiny",
       "--steps", "3", "--microbatches", "2", "--out", str(out), "--png", "", "--trace", ""],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    nodes: set[int] = set()
    for line in proc.stderr:  # progress lines; the first finished run says "round 1/"
      nodes |= set(procs.children(proc.pid, NODE))
      if "round 1/" in line:
        break
    assert len(nodes) == 2, nodes
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  assert proc.returncode == 130, err[-3000:]
  assert "interrupted by SIGINT" in err
  report = json.loads((out / "bench.json").read_text())
  assert report["interrupted"] is True and report["runs"]
  assert not any(procs.running(pid) for pid in nodes), nodes


def test_a_node_killed_mid_bench_ends_it_with_one_line_and_nothing_left(tmp_path):
  """SIGKILL to one trainer node once the first mode run finished: the next call to it fails,
  the bench says in one line which run failed and that the node exited, exits 1, and the other
  node is stopped too."""
  proc = subprocess.Popen(
      [sys.executable, "-m", "tunix_stage_plugin.cli.main", "bench", "--host", "tunix", "--tiny",
       "--quick", "--steps", "1", "--microbatches", "2", "--out", str(tmp_path / "out"),
       "--png", "", "--trace", ""],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    nodes: set[int] = set()
    for line in proc.stderr:
      nodes |= set(procs.children(proc.pid, NODE))
      if "round 1/" in line:  # inline ran on the node without the plugin; staged modes follow
        break
    assert len(nodes) == 2, nodes
    (plugin_node,) = procs.children(proc.pid, b'"plugin": true')
    os.kill(plugin_node, signal.SIGKILL)
    out, err = proc.communicate(timeout=180)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 1, out[-2000:] + err[-3000:]
  last = err.strip().splitlines()[-1]
  assert last.startswith("tunix-stage bench: error: the depth1 run on tunix's host failed: "), last
  assert "the plugin node exited with code -9" in last, last
  assert "Traceback" not in err
  assert not any(procs.running(pid) for pid in nodes), nodes


def test_the_host_path_leaves_out_what_the_trainers_receive_pool_held_back():
  """Spans as a run records them (the node's clock 100 s behind this process's): a stage call of
  0.5 s whose bytes waited 0.3 s for the bounded pool, and an inline micro-batch placed 0.4 s
  after the answer before it, 0.1 s of that waiting. The host path counts 0.2 s and 0.3 s."""
  span = recorder_lib.Span
  node = [
      span(tracks.DEVICE_COMPUTE, "c", 0.0, 0.6, (("answered", 0.1), ("kind", "fwd_bwd"))),
      span(tracks.TRAINER_POOL_WAIT, "pool wait", 0.15, 0.25, (("bytes", 1),)),
      span(tracks.TRAINER_H2D, "s1-m1", 0.5, 0.6, (("bytes", 1 << 30), ("lane", "inline"),
                                                   ("step", 1))),
      span(tracks.TRAINER_POOL_WAIT, "pool wait", 1.0, 1.3, (("bytes", 1),)),
      span(tracks.TRAINER_H2D, "s1-m2", 1.5, 1.6, (("bytes", 1 << 30), ("lane", "staging"),
                                                   ("step", 1))),
  ]
  calls = [span(tracks.ORCHESTRATOR_STAGE, "stage s1 m2", 100.9, 101.4)]
  waits = tunix_bench.pool_waits(node, calls, offset=100.0)
  assert waits == [pytest.approx(0.3)]
  path = tunix_bench.host_path(node, calls, waits, since=0.0, offset=100.0)
  assert path["staged"]["receive_s"] == pytest.approx(0.2)
  assert path["inline"]["receive_s"] == pytest.approx(0.3)
