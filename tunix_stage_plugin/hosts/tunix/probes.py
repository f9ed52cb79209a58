"""Capability probes: does this tunix have what each hook relies on, with the expected shape?

Run before anything is patched; any failure means nothing is installed. A probe checks the
attributes the hooks call or replace (and that the names the hooks add are still free, so a tunix
that grew its own stage_batch is not silently overridden). The staged train loop reproduces
StandardRLProgram.train_stage's body, so that body is pinned by its fingerprint: a tunix whose
loop does more (or else) is refused, unless its fingerprint is accepted by
TUNIX_STAGE_ACCEPT_TRAIN_STAGE (docs/tunix.md, "The train loop's fingerprint").
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.hosts import probing
from tunix_stage_plugin.hosts.probing import Probe, check as _check, free as _free
from tunix_stage_plugin.hosts.probing import method as _method, parameters as _params

# probing.fingerprint of StandardRLProgram.train_stage at tunix c7d8950: the body the staged loop
# (program.py) reproduces.
TRAIN_STAGE_FINGERPRINT = "0db6a891a29dd479"
TRAIN_STAGE_COMMIT = "c7d8950"
ACCEPT = config_lib.SETTINGS_BY_FIELD["accept_train_stage"]


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
            or (None if "self._server = " in inspect.getsource(server.start_serving_async)
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
            or _free(worker, "stage_batch", "reset_staged"))

  def trainer_seam() -> str | None:
    # fwd_bwd must prepare through the seam (inline and staged are then the same computation).
    calls_seam = "self._prepare_payload(" in inspect.getsource(peft.fwd_bwd)
    return (_method(peft, "_prepare_payload", params=("payload",), coroutine=False, own=True)
            or _method(peft, "fwd_bwd", params=("payload",), coroutine=False, own=True)
            or (None if calls_seam else "PeftTrainer.fwd_bwd does not call self._prepare_payload"))

  def error_envelope() -> str | None:
    try:
      m.remote_execution.ExecutionResponse(error_message="m", error_type="StageKeyError").unwrap()
    except RuntimeError as e:
      if remote_error_type(e) == "StageKeyError":
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
      _check("program: StandardRLProgram.train_stage's body", program_body),
  ]


_REMOTE_ERROR = re.compile(
    r"RemoteExecutionError \[(?P<type>[A-Za-z_][A-Za-z0-9_.]*)\](: (?P<message>[^\n]*))?")


def remote_error_type(error: BaseException) -> str | None:
  """The remote exception's type name in the host's error envelope (ExecutionResponse.unwrap)."""
  match = _REMOTE_ERROR.match(str(error))
  return match["type"] if match else None


def remote_error_message(error: BaseException) -> str:
  """The remote exception's own message (its first line), without the envelope's prefix."""
  match = _REMOTE_ERROR.match(str(error))
  return (match["message"] or "") if match else str(error).split("\n", 1)[0]
