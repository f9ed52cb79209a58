"""The summary's one rule (summary.RULE, said in the report's header): medians per step leave a
first step out where there are others; totals and counts are over every step, as the tables they
sum. Whether a run staged, as its records say."""

from __future__ import annotations

import json

from tests.cli.test_report import report
from tunix_stage_plugin.core.telemetry import record as record_lib
from tunix_stage_plugin.reading import records as records_lib
from tunix_stage_plugin.reading import report as report_cmd
from tunix_stage_plugin.reading import runs as runs_lib
from tunix_stage_plugin.reading import summary as summary_lib

MIB = 1 << 20


def orchestrator_step(step, stage_median_s):
  return {"time": 10.0 + step, "step": step, "step_s": None if step == 0 else 2.0,
          "microbatches": 4, "depth": 1, "staged": 3, "inline": 1, "prestaged": 0,
          "peak_staged": 1, "fallbacks": {"count": 1, "by_kind": {"refused": 1}},
          "stage_calls": {"count": 3, "seconds": 3 * stage_median_s, "median_s": stage_median_s,
                          "max_s": stage_median_s},
          "sent": {"side": {"calls": 4, "bytes": 4 * MIB, "seconds": 0.4}}}


def test_medians_leave_the_first_step_out_and_totals_count_every_step():
  steps = [record_lib.make(record_lib.ORCHESTRATOR, "tunix", orchestrator_step(step, median),
                           {}, run) for (step, median), run in zip(
                               ((0, 5.0), (1, 0.1), (2, 0.3)), [record_lib.new_run()] * 3)]
  tables = records_lib.of_records(steps)
  o = summary_lib.summary(tables[record_lib.TRAINER],
                          tables[record_lib.ORCHESTRATOR])["orchestrator"]
  assert o["stage_call_median_s"] == 0.2  # step 0's compiling 5 s left out
  assert (o["staged"], o["inline"], o["fallbacks"]) == (9, 3, 3)
  assert o["fallbacks_by_kind"] == {"refused": 3}
  assert o["sent"]["side"]["calls"] == 12 and o["sent"]["side"]["bytes"] == 12 * MIB
  assert "a first step out" in summary_lib.RULE and "totals are over every step" in summary_lib.RULE


def test_an_orchestrator_whose_every_stage_fell_back_did_not_stage_and_the_rule_judges_it(
    tmp_path):
  """Staging on, every stage refused (a full bound) or failed: the run did not stage, said by
  kind; no setting is named to turn it on (it was on), and with no trainer record the report
  does not say that staging kept the trainer's input ready. The records are record.make's."""
  run_id = record_lib.new_run()
  steps = [record_lib.make(record_lib.ORCHESTRATOR, "tunix", {
      **orchestrator_step(step, 0.1), "staged": 0, "inline": 4, "prestaged": 0,
      "fallbacks": {"count": 4, "by_kind": {"refused": 3, "failed": 1}}}, {}, run_id)
           for step in range(3)]
  path = tmp_path / "orchestrator.jsonl"
  path.write_text("".join(json.dumps(s) + "\n" for s in steps), encoding="utf-8")
  (run,), _ = runs_lib.runs([str(path)])
  (process,) = run.processes
  assert summary_lib.staging(run) == {
      "staged": False, "role": None, "turn_on": None,
      "said": f"orchestrator {process.name}'s stages all fell back inline (9 refused, 3 "
              "failed); 12 trained inline"}
  out = report(str(path)).stdout
  assert f"  did not stage: {summary_lib.staging(run)['said']}\n" in out
  assert out.splitlines()[-1] == f"recommendation: {report_cmd.NO_TRAINER_RECORD}"
