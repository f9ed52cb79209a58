"""probing.fingerprint: a host method's code as 16 hex digits, blind to formatting, comments, the
docstring and the Python version (3.11 to 3.13), changed by any changed statement.

The tunix program's probe pins StandardRLProgram.train_stage with it (its tests against real
tunix: tests/hosts/tunix/test_activation.py).
"""

from __future__ import annotations

import ast

import pytest

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.hosts import probing

LOOP = '''
async def train_stage(self, engine, num_steps=None):
  """Trains."""
  step = 0
  while num_steps is None or step < num_steps:
    items = await self.queue.get_batch(num_groups=1)
    if not items:
      break
    rewards = [float(getattr(item, "reward", 0.0)) for item in items]
    await engine.train_step(items, apply_optimizer=True)
    self.last = {"step": step, "mean": sum(rewards) / len(rewards)}
    step += 1
'''

# LOOP's fingerprint, the same under Python 3.11.7, 3.12.1 and 3.13.0 (the suite runs under one
# of them; each was run by hand). A plain ast.dump of it differs between each two of them.
LOOP_FINGERPRINT = "83a1137e93192d38"

REFORMATTED = '''
async def train_stage(self,
                      engine,
                      num_steps = None):
    # Another docstring, other comments, other line breaks and indentation.
    """Trains, step by step."""
    step = 0
    while (num_steps is None
           or step < num_steps):  # until num_steps
        items = await self.queue.get_batch(
            num_groups=1,
        )
        if not items:
            break
        rewards = [float(getattr(item, 'reward', 0.0))
                   for item in items]
        await engine.train_step(items, apply_optimizer=True)
        self.last = {'step': step, 'mean': sum(rewards) / len(rewards)}
        step += 1
'''


def test_the_fingerprint_is_16_hex_digits_and_the_same_on_every_python():
  assert probing.source_fingerprint(LOOP) == LOOP_FINGERPRINT


def test_formatting_comments_and_the_docstring_keep_it():
  assert probing.source_fingerprint(REFORMATTED) == LOOP_FINGERPRINT
  no_docstring = LOOP.replace('  """Trains."""\n', "")
  assert probing.source_fingerprint(no_docstring) == LOOP_FINGERPRINT
  assert probing.source_fingerprint(ast.unparse(ast.parse(LOOP))) == LOOP_FINGERPRINT


@pytest.mark.parametrize("old, new", [
    ("    step += 1\n", "    self.checkpoint(step)\n    step += 1\n"),  # a statement added
    ("      break\n", "      continue\n"),  # a statement changed
    ('"reward", 0.0', '"reward", 1.0'),  # a default
    ("apply_optimizer=True", "apply_optimizer=False"),  # a keyword's value
    ("step < num_steps", "step <= num_steps"),  # an operator
    ("num_groups=1", "num_groups=2"),  # a constant
    ("engine, num_steps=None", "engine, num_steps=1"),  # the signature
    ("async def", "@staticmethod\nasync def"),  # a decorator
    ('  """Trains."""\n  step = 0\n', '  "Trains."\n  """Again."""\n  step = 0\n'),  # a 2nd string
])
def test_a_changed_statement_changes_it(old, new):
  assert LOOP.count(old) == 1
  assert probing.source_fingerprint(LOOP.replace(old, new)) != LOOP_FINGERPRINT


def defined_here(a, b=2):  # a method-like function with its own source in this file
  """Adds."""
  return a + b


class Holder:

  def method(self, a):
    return a * 2


def test_fingerprint_reads_a_function_s_source_methods_included():
  assert probing.fingerprint(defined_here) == probing.source_fingerprint(
      'def defined_here(a, b=2):\n  return a + b\n')
  assert probing.fingerprint(Holder.method) == probing.source_fingerprint(
      "def method(self, a):\n    return a * 2\n")


def test_no_source_is_an_oserror():
  namespace: dict = {}
  exec(compile("def f():\n  return 1\n", "<no file>", "exec"), namespace)  # pylint: disable=exec-used
  with pytest.raises(OSError):
    probing.fingerprint(namespace["f"])


def test_only_a_function_definition_is_fingerprinted():
  with pytest.raises(ValueError, match="expected one function definition; got ClassDef"):
    probing.source_fingerprint("class A:\n  pass\n")


def test_the_setting_accepts_a_fingerprint_and_nothing_else():
  cfg = config_lib.resolve({"accept_train_stage": LOOP_FINGERPRINT}, env={})
  assert cfg.accept_train_stage == LOOP_FINGERPRINT
  assert config_lib.resolve({}, env={}).accept_train_stage == ""  # default: none accepted
  for bad in ("yes", LOOP_FINGERPRINT.upper(), LOOP_FINGERPRINT[:-1], LOOP_FINGERPRINT + "0"):
    with pytest.raises(config_lib.ConfigError) as e:
      config_lib.resolve({}, env={"TUNIX_STAGE_ACCEPT_TRAIN_STAGE": bad})
    assert e.value.problems == [
        f"TUNIX_STAGE_ACCEPT_TRAIN_STAGE={bad!r} is invalid; accepted: the 16 hex digits a "
        "refusal line printed for tunix's StandardRLProgram.train_stage"]
