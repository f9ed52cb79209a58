"""Probes that read parsed code, not text: a comment or a string naming what a probe looks for
does not satisfy it (activation/drivers.py's driver flags, hosts/maxtext/adapter.py's order); and
a probe table (hosts/probing.py `run`) refuses with each row's first failing check."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest

from tunix_stage_plugin.activation import drivers
from tunix_stage_plugin.hosts import probing
from tunix_stage_plugin.hosts import triggers
from tunix_stage_plugin.hosts.maxtext import adapter as maxtext_adapter

SOURCE = textwrap.dedent('''
    import argparse


    def defines(argv):
      parser = argparse.ArgumentParser()
      parser.add_argument("--stage_train_batches", default="off")
      return parser.parse_args(argv)


    def mentions(argv):
      # like the upstream driver's --stage_train_batches, but not here
      parser = argparse.ArgumentParser(description="takes no --stage_train_batches")
      return parser.parse_args(argv)


    class Engine:

      def prepares_first(self, payload, **kwargs):
        batch = self._prepare_batch(payload)
        self._throttler.wait_for_next()
        return batch

      def waits_first(self, payload, **kwargs):
        self._throttler.wait_for_next()  # then self._prepare_batch(payload)
        return self._prepare_batch(payload)

      def says_it(self, payload, **kwargs):
        "self._prepare_batch(payload) before self._throttler.wait_for_next()"
        self._throttler.wait_for_next()
        return payload
''')


@pytest.fixture
def module(tmp_path):
  path = tmp_path / "parsed_probe_subject.py"
  path.write_text(SOURCE)
  spec = importlib.util.spec_from_file_location("parsed_probe_subject", path)
  loaded = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(loaded)
  yield loaded
  sys.modules.pop("parsed_probe_subject", None)


def test_a_driver_defines_the_staging_flags_only_by_an_add_argument_call(module):
  def driver(parse):
    return triggers.Driver(module.__name__, "tunix", parse, "a test driver")

  assert drivers.defines_flags(module, driver("defines"))
  assert not drivers.defines_flags(module, driver("mentions"))


def test_maxtext_fwd_bwd_must_prepare_before_it_waits_by_its_calls(module):
  assert maxtext_adapter._prepares_first(module.Engine.prepares_first) is None  # pylint: disable=protected-access
  for fwd_bwd in (module.Engine.waits_first, module.Engine.says_it):
    problem = maxtext_adapter._prepares_first(fwd_bwd)  # pylint: disable=protected-access
    assert problem and "does not call self._prepare_batch(payload) before waiting" in problem


def test_a_probe_table_refuses_with_its_first_failing_check_per_row():
  class Host:
    def fwd_bwd(self, payload, **kwargs):
      return payload

  subject = type("Subject", (), {"Host": Host, "fields": ("a",)})
  table = (
      ("ok", (probing.has_method("Host", "fwd_bwd", params=("payload",), coroutine=False),
              probing.is_free("Host", "stage_batch"))),
      ("first of two", (probing.has_all("Host's fields", lambda s: s.fields, ("a", "b", "c")),
                        probing.that(lambda s: False, "never reached"))),
      ("raises", (probing.that(lambda s: s.missing, "unused"),)),
      ("shape", (probing.has_method("Host", "fwd_bwd", params=("payload",), coroutine=True),)),
  )
  assert [(p.name, p.ok, p.detail) for p in probing.run(table, subject)] == [
      ("ok", True, "ok"),
      ("first of two", False, "Host's fields lacks ['b', 'c']"),
      ("raises", False, "AttributeError: type object 'Subject' has no attribute 'missing'"),
      ("shape", False, "test_a_probe_table_refuses_with_its_first_failing_check_per_row.<locals>"
                       ".Host.fwd_bwd is not a coroutine function"),
  ]
