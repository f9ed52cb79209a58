"""Capability probes: does this tunix have what each hook relies on, with the expected shape?

Run before anything is patched; any failure means nothing is installed. A probe checks the
attributes the hooks call or replace, what their bodies do (read from the parsed code, never from
text), and that the names the hooks add are still free, so a tunix that grew its own stage_batch
is not silently overridden. The train loop is staged one of two ways (`loop_way`): through the
loop's seam (`_step_microbatches` / `_train_microbatches`, patches/tunix-plugins-entry-point.patch),
checked by its parsed code; or, on a tunix without the seam, by the plugin's copy of
StandardRLProgram.train_stage, whose body is pinned by its fingerprint, so a tunix whose loop does
more (or else) is refused unless TUNIX_STAGE_ACCEPT_TRAIN_STAGE accepts it (docs/tunix.md, "The
train loop, two ways").
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from typing import Any

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import keys as keys_lib
from tunix_stage_plugin.hosts import probing
from tunix_stage_plugin.hosts.probing import Probe, check as _check, free as _free
from tunix_stage_plugin.hosts.probing import method as _method, parameters as _params
from tunix_stage_plugin.hosts.tunix import contract

# The two ways the train loop is staged (program.py).
SEAM = "seam"  # tunix's train_stage, unchanged; the plugin stages through the loop's seam
COPY = "copy"  # the plugin's copy of tunix c7d8950's train_stage replaces it (fingerprint-pinned)
SEAM_METHODS = ("_step_microbatches", "_train_microbatches")
STEP_MICROBATCHES_FIELDS = frozenset({"batches", "groups", "rewards", "num_rollouts",
                                      "num_microbatches"})
# probing.fingerprint of StandardRLProgram.train_stage at tunix c7d8950: the body the staged loop
# (program.py) reproduces on a tunix without the seam.
TRAIN_STAGE_FINGERPRINT = "0db6a891a29dd479"
TRAIN_STAGE_COMMIT = "c7d8950"
ACCEPT = config_lib.SETTINGS_BY_FIELD["accept_train_stage"]


def loop_way(program_cls: type) -> str:
  """SEAM when StandardRLProgram defines either of the loop's seam methods (then the seam must
  have its whole shape, `program_seam` below), else COPY."""
  return SEAM if any(m in vars(program_cls) for m in SEAM_METHODS) else COPY


def describe_loop(way: str) -> str:
  """The train loop's way, as the activation line and doctor say it."""
  if way == SEAM:
    return ("tunix's train_stage, staged through its seam (_step_microbatches, "
            "_train_microbatches)")
  return f"the plugin's copy of tunix {TRAIN_STAGE_COMMIT}'s train_stage (fingerprint-pinned)"


def run(m: Any, config: config_lib.StageConfig) -> list[Probe]:
  try:
    base_server = m.remote_execution.RemoteExecutionServer
    server = m.remote_execution.GrpcRemoteExecutionServer
    worker = m.trainer_worker.TrainerWorker
    engine = m.engine.DistributedRLEngine
    program = m.program.StandardRLProgram
    result = m.program.RLStepResult
    peft = m.peft_trainer.PeftTrainer
  except AttributeError as e:  # a tunix whose modules lack the classes the hooks patch
    return [Probe("tunix classes the hooks patch", False, f"AttributeError: {e}")]
  step_fields = {"step", "policy_version", "num_rollouts", "num_microbatches", "reward_mean",
                 "reward_std", "train_result"}

  def server_routing() -> str | None:
    return (_method(base_server, "execute_request", params=("request",), coroutine=True,
                    own=True)
            or _method(base_server, "execute_sync_request", params=("request",),
                       coroutine=False)
            or (None if isinstance(inspect.getattr_static(base_server, "bound_instance"), property)
                else "bound_instance is not a property")
            or (None if issubclass(server, base_server) and "execute_request" not in vars(server)
                else "GrpcRemoteExecutionServer overrides execute_request")
            or _method(server, "stop_serving", params=(), coroutine=True, own=True)
            or _free(base_server) or _free(server))

  def server_stream() -> str | None:
    # The stream's handler joins the grpc server start_serving_async assigns to self._server
    # (before it starts); the orchestrator dials a handle's address with tunix's options and cap.
    # pylint: disable=protected-access
    remote = m.remote_execution
    handle = remote.GrpcRemoteActorHandle("grpc://127.0.0.1:1", rpc_timeout_s=1.5)  # dials nothing
    request_params = {"request_id", "method_name", "args", "kwargs"}
    return (_method(server, "start_serving_async", params=("port",), coroutine=True, own=True)
            or (None if probing.Body(server.start_serving_async).assigns("self._server")
                else "GrpcRemoteExecutionServer.start_serving_async does not assign self._server")
            or (None if "_server" not in vars(server) else
                "GrpcRemoteExecutionServer has a class attribute _server")
            or (None if isinstance(remote._MAX_MESSAGE_BYTES, int) else
                "remote_execution._MAX_MESSAGE_BYTES is not an int")
            or (None if callable(remote._grpc_options) else
                "remote_execution._grpc_options is missing")
            or (None if (handle.target_address, handle._rpc_timeout_s) ==
                ("grpc://127.0.0.1:1", 1.5) else
                "GrpcRemoteActorHandle keeps no target_address / _rpc_timeout_s")
            or (None if "payload" in _params(remote.ExecutionResponse.deserialize) else
                "ExecutionResponse.deserialize(payload) is missing")
            or (None if request_params <= set(_params(remote.ExecutionRequest.__init__)) else
                "ExecutionRequest.__init__ lacks request_id/method_name/args/kwargs"))

  def worker_api() -> str | None:
    return (_method(worker, "fwd_bwd", params=("payload",), coroutine=False, var_kwargs=True,
                    own=True)
            or _method(worker, "_response", params=(), coroutine=False, var_kwargs=True)
            or _free(worker, contract.STAGE_BATCH, contract.RESET_STAGED))

  def trainer_seam() -> str | None:
    # fwd_bwd must prepare through the seam (inline and staged are then the same computation).
    calls_seam = bool(probing.Body(peft.fwd_bwd).calls("self._prepare_payload"))
    return (_method(peft, "_prepare_payload", params=("payload",), coroutine=False, own=True)
            or _method(peft, "fwd_bwd", params=("payload",), coroutine=False, own=True)
            or (None if calls_seam else "PeftTrainer.fwd_bwd does not call self._prepare_payload"))

  def error_envelope() -> str | None:
    try:
      m.remote_execution.ExecutionResponse(error_message="m", error_type="StageKeyError").unwrap()
    except RuntimeError as e:
      typed = contract.typed_error(e, contract.STAGE_BATCH)
      if isinstance(typed, keys_lib.StageKeyError) and str(typed) == "m":
        return None
      return f"the remote error envelope changed: {str(e)[:80]!r}"
    return "ExecutionResponse.unwrap() did not raise for an error response"

  def engine_api() -> str | None:
    return (_method(engine, "train_step", params=("payload", "role", "accumulate_gradients",
                                                  "apply_optimizer"),
                    coroutine=True, var_kwargs=True)
            or _method(engine, "_invoke_worker", params=("worker", "method_name"),
                       coroutine=True, var_kwargs=True)
            or _method(engine, "per_token_logps", params=("role", "items"), coroutine=True)
            or _method(engine, "sync_weights", params=("role",), coroutine=True)
            or _free(engine, "stage_train_batch", "reset_staged_batches"))

  def program_loop() -> str | None:
    missing_init = [p for p in ("algo", "assembler", "mini_batch_size", "max_staleness",
                                "sync_weights", "on_step_begin", "on_step_end")
                    if p not in _params(program.__init__)]
    fields = {f.name for f in dataclasses.fields(result)}
    return (_method(program, "train_stage", params=("engine", "num_steps"), coroutine=True,
                    own=True)
            or (f"StandardRLProgram.__init__ lacks {missing_init}" if missing_init else None)
            or (f"RLStepResult lacks {sorted(step_fields - fields)}"
                if step_fields - fields else None)
            or _free(program, "_stage_ahead_while_pending", "_prestage_across_boundary"))

  def program_seam() -> str | None:
    # The loop's seam (patches/tunix-plugins-entry-point.patch), by its parsed code: train_stage
    # makes each step's micro-batches, trains them through _train_microbatches and records the
    # step's result; _train_microbatches is the per-micro-batch loop the staged one stands in for.
    made = getattr(m.program, "StepMicrobatches", None)
    if made is None or not dataclasses.is_dataclass(made):
      return "rl_program.StepMicrobatches (a dataclass) is missing"
    missing = STEP_MICROBATCHES_FIELDS - {f.name for f in dataclasses.fields(made)}
    if missing:
      return f"rl_program.StepMicrobatches lacks {sorted(missing)}"
    problem = (_method(program, "_step_microbatches", params=("engine",), coroutine=False,
                       own=True)
               or _method(program, "_train_microbatches", params=("engine", "step",
                                                                  "microbatches"),
                          coroutine=True, own=True)
               or _free(program, "last_step_result"))
    if problem is not None:
      return problem
    loop, seam = probing.Body(program.train_stage), probing.Body(program._train_microbatches)  # pylint: disable=protected-access
    order = loop.call_order("self._step_microbatches", "self._train_microbatches")
    if order != ["self._step_microbatches", "self._train_microbatches"]:
      return ("StandardRLProgram.train_stage does not call self._step_microbatches, then "
              "self._train_microbatches")
    if loop.calls("engine.train_step"):
      return "StandardRLProgram.train_stage calls engine.train_step itself, beside the seam"
    if not loop.assigns("self.last_step_result"):
      return "StandardRLProgram.train_stage does not assign self.last_step_result"
    trains = [c for f in seam.iterates("microbatches.batches", is_async=True)
              for c in ast.walk(f) if isinstance(c, ast.Call)
              and probing.dotted(c.func) == "engine.train_step"]
    if not any({"accumulate_gradients", "apply_optimizer"} <= probing.keywords(c)
               for c in trains):
      return ("StandardRLProgram._train_microbatches does not call engine.train_step("
              "..., accumulate_gradients=, apply_optimizer=) for each of microbatches.batches")
    return None

  def program_body() -> str | None:
    train_stage = vars(program).get("train_stage")
    if train_stage is None:
      return "StandardRLProgram has no train_stage of its own"
    try:
      found = probing.fingerprint(train_stage)
    except OSError as e:
      return (f"its source is not available ({e}), so it cannot be checked against the body the "
              "plugin's staged loop reproduces")
    if found in (TRAIN_STAGE_FINGERPRINT, config.accept_train_stage):
      return None
    other = (f" ({ACCEPT.env}={config.accept_train_stage} accepts another body)"
             if config.accept_train_stage else "")
    return (f"fingerprint {found} differs from tunix {TRAIN_STAGE_COMMIT}'s "
            f"{TRAIN_STAGE_FINGERPRINT}, the body the plugin's staged loop reproduces and would "
            f"replace{other}; upgrade tunix-stage-plugin, or check that the staged loop still does "
            f"what this body does (docs/tunix.md) and set {ACCEPT.env}={found}")

  if loop_way(program) == SEAM:
    loop_probe = _check("program: the train loop's seam (_step_microbatches, "
                        "_train_microbatches)", program_seam)
  else:
    loop_probe = _check("program: StandardRLProgram.train_stage's body", program_body)
  return [
      _check("server: RemoteExecutionServer.execute_request routing", server_routing),
      _check("server: a chunked stream beside GrpcRemoteExecutionServer's methods",
             server_stream),
      _check("worker: TrainerWorker.fwd_bwd(payload, **kwargs)", worker_api),
      _check("trainer: PeftTrainer.fwd_bwd prepares through _prepare_payload(payload)",
             trainer_seam),
      _check("server: RemoteExecutionError [type] envelope", error_envelope),
      _check("engine: DistributedRLEngine.train_step(**kwargs) / _invoke_worker", engine_api),
      _check("program: StandardRLProgram.train_stage / RLStepResult", program_loop),
      loop_probe,
  ]

