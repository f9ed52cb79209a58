"""`tunix-stage bench --host tunix`: the A/B on real tunix processes (lab/tunix).

Real trainer node processes (tunix's GrpcRemoteExecutionServer, TrainerWorker and PeftTrainer
on a 2-device CPU mesh), driven with tunix's DistributedRLEngine and StandardRLProgram from this
process: one pair for the module (`nodes`), which each bench run here adopts (the command runs in
this process), its state set again before every job as in any bench; the tests that stop or kill
a node run the command in a process of its own, with its own pair. --tiny runs: their step times
mean nothing, so only the structure and the correctness checks are asserted (timing claims live
in the bench's figures, docs/bench.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from tunix_stage_plugin.cli import main as cli_main
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


# The module's nodes; a run on them may differ in the payload's size and the run's length.
NODES = results.BenchOptions(host="tunix", tiny=True, microbatches=2, steps=1)
NODE_SPEC = ("tiny", "payload", "seed", "microbatches", "max_device_batches", "max_host_batches",
             "codec")  # what a node is started with (BenchHost.start) besides the payload's size


class _Adopted(tunix_bench.BenchHost):
  """The bench's tunix host on the module's nodes: start() adopts them (as they serve), open()
  gives them this run's payload size, stop() leaves them serving and says a node's exit code if
  one exited meanwhile (else 0)."""

  def __init__(self, options, shared):
    assert all(getattr(options, f) == getattr(NODES, f) for f in NODE_SPEC), options
    super().__init__(options)
    self.shared = shared

  def start(self, say):
    del say
    self.nodes = {kind: dataclasses.replace(node, handle=None)
                  for kind, node in self.shared.items()}

  async def open(self):
    await super().open()
    for node in self.nodes.values():
      await node.handle.asubmit("bench_setup", self.options.sizes().as_dict())

  def stop(self):
    if not self.nodes:
      return None
    return next((code for node in self.nodes.values() if (code := node.proc.poll())), 0)


@pytest.fixture(scope="module")
def nodes():
  """One pair of trainer nodes (node.py, without and with the plugin) for the module's bench
  runs; stopped at the end, both exiting 0, none left."""
  host = tunix_bench.BenchHost(NODES)
  try:
    host.start(lambda _: None)
    yield host.nodes
  finally:
    code = host.stop()
  assert code == 0
  assert not any(procs.running(pid) for pid in host.pids), host.pids


@pytest.fixture(name="bench")
def fixture_bench(nodes, monkeypatch, capsys, tmp_path):
  """`tunix-stage bench --host tunix --tiny --quick --steps 1 --microbatches 2 ARGS` in this
  process, on the module's nodes: (its output folder, its JSON, its stdout)."""
  monkeypatch.setattr(host_lib, "load", lambda options: _Adopted(options, nodes))
  monkeypatch.delenv("GRPC_VERBOSITY", raising=False)  # the command sets it

  def run(*args):
    out = tmp_path / "out"
    code = cli_main.main(["bench", "--host", "tunix", "--tiny", "--quick", "--steps", "1",
                          "--microbatches", "2", "--out", str(out), *args])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    return out, json.loads((out / "bench.json").read_text()), stdout

  return run


def test_every_mode_on_tunix_trains_the_same_parameters_in_order(bench, capsys):
  out, report, stdout = bench()
  assert report["options"]["host"] == "tunix"
  assert "tunix-stage bench on the tunix host" in stdout
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
  code = cli_main.main(["simulate", "--check", str(out / "bench.json"), "--json", "-"])
  check = capsys.readouterr()
  assert code == 0, check.err
  assert set(json.loads(check.out)["modes"]) == set(modes)
  code = cli_main.main(["bench", "--compare", str(out / "bench.json"), str(out / "bench.json")])
  compare = capsys.readouterr()
  assert code == 0, compare.err
  assert "depth2_prestage" in compare.out


def test_inline_runs_with_nothing_of_the_plugin_installed_on_either_side(nodes):
  """The inline mode is tunix byte for byte: the node it runs on reports no plugin (checked when
  the host connects), and in this process nothing is installed while tunix's loop runs it; a
  staged mode installs the plugin here for its run only."""
  options = results.BenchOptions(host="tunix", tiny=True, microbatches=2, steps=1)
  host = _Adopted(options, nodes)
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


def test_over_tunix_message_cap_inline_takes_the_plugins_path_and_trains_the_same(bench):
  """160 MiB micro-batches (over tunix's 128 MiB cap): tunix's unary call cannot carry them, so
  inline runs on the plugin's node staging nothing, and every mode still trains the same
  parameters."""
  options = results.BenchOptions(host="tunix", tiny=True, payload_mib=160)
  host = tunix_bench.BenchHost(options)
  assert host.over_cap(options.sizes())
  assert host.node_for("inline") == tunix_bench.PLUGIN
  assert host.node_for("resident") == tunix_bench.PLAIN
  _, report, _ = bench("--payload_mib", "160", "--modes", "inline,depth2_prestage,resident")
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


def test_a_node_s_stderr_is_read_as_it_comes_so_a_chatty_node_never_blocks():
  """A process writing 1 MiB to stderr (16 times a pipe's buffer: a long bench's per-step lines
  and tunix's log) exits on its own while its stderr is drained; the last line is kept."""
  proc = subprocess.Popen(
      [sys.executable, "-c", "import sys\nfor i in range(16384): print('x' * 63, file=sys.stderr)\n"
       "print('the last line', file=sys.stderr)"],
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  drain = tunix_bench._Drain(proc.stderr)  # pylint: disable=protected-access
  assert proc.wait(60) == 0
  assert drain.last(10) == "the last line"
  proc.stderr.close()
