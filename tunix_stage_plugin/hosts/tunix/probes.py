"""Capability probes: does this tunix have what each hook relies on, with the expected shape?

Run before anything is patched; any failure means nothing is installed. The probes are a table
(`PROBES`, then the train loop's: `COPY_PROBE`, or the seam's in loop_seam.py; hosts/probing.py
`run`) over the tunix classes (`Tunix`): the attributes the hooks call or replace, what their
bodies do (from the parsed code), and that the names the hooks add are still free. `loop_way`
picks how the train loop is staged (docs/tunix.md "The train loop, two ways").
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from tunix_stage_plugin.core import config as config_lib
from tunix_stage_plugin.core import contract
from tunix_stage_plugin.hosts import probing
from tunix_stage_plugin.hosts.probing import Probe, has_all, has_method, is_free, that
from tunix_stage_plugin.hosts.probing import parameters as _params

# The two ways the train loop is staged (program.py).
SEAM = "seam"  # tunix's train_stage, unchanged; the plugin stages through the loop's seam
COPY = "copy"  # the plugin's copy of tunix c7d8950's train_stage replaces it (fingerprint-pinned)
SEAM_METHODS = ("_step_microbatches", "_train_microbatches")
STEP_RESULT_FIELDS = frozenset({"step", "policy_version", "num_rollouts", "num_microbatches",
                                "reward_mean", "reward_std", "train_result"})
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
            "_train_microbatches; a subclass's own _train_microbatches stages only if it calls "
            "tunix's)")
  return f"the plugin's copy of tunix {TRAIN_STAGE_COMMIT}'s train_stage (fingerprint-pinned)"


@dataclasses.dataclass(frozen=True)
class Tunix:
  """What the probes read: the tunix classes the hooks patch or call, and the settings."""

  base_server: type  # remote_execution.RemoteExecutionServer
  server: type  # remote_execution.GrpcRemoteExecutionServer
  worker: type  # trainer_worker.TrainerWorker
  engine: type  # distributed_rl_engine.DistributedRLEngine
  program: type  # rl_program.StandardRLProgram
  result: type  # rl_program.RLStepResult
  peft: type  # peft_trainer_v2.PeftTrainer
  remote: Any  # the remote_execution module
  program_module: Any  # the rl_program module
  config: config_lib.StageConfig


def run(m: Any, config: config_lib.StageConfig,
        loop: tuple[str, tuple[probing.Check, ...]]) -> list[Probe]:
  """Every probe of PROBES, then `loop`, the train loop's (by its way: COPY_PROBE or
  loop_seam.PROBE), on `m`'s tunix classes."""
  try:
    tunix = Tunix(m.remote_execution.RemoteExecutionServer,
                  m.remote_execution.GrpcRemoteExecutionServer, m.trainer_worker.TrainerWorker,
                  m.engine.DistributedRLEngine, m.program.StandardRLProgram, m.program.RLStepResult,
                  m.peft_trainer.PeftTrainer, m.remote_execution, m.program, config)
  except AttributeError as e:  # a tunix whose modules lack the classes the hooks patch
    return [Probe("tunix classes the hooks patch", False, f"AttributeError: {e}")]
  return probing.run((*PROBES, loop), tunix)


def _stream_handle(t: Tunix) -> bool:
  # The orchestrator dials a handle's address with tunix's options and cap.
  handle = t.remote.GrpcRemoteActorHandle("grpc://127.0.0.1:1", rpc_timeout_s=1.5)  # dials nothing
  return (handle.target_address, handle._rpc_timeout_s) == ("grpc://127.0.0.1:1", 1.5)  # pylint: disable=protected-access


def error_envelope(t: Tunix) -> str | None:
  try:
    t.remote.ExecutionResponse(error_message="m", error_type="StageKeyError").unwrap()
  except RuntimeError as e:
    typed = contract.typed_error(e, contract.STAGE_BATCH)
    if isinstance(typed, contract.StageKeyError) and str(typed) == "m":
      return None
    return f"the remote error envelope changed: {str(e)[:80]!r}"
  return "ExecutionResponse.unwrap() did not raise for an error response"


def program_body(t: Tunix) -> str | None:
  train_stage = vars(t.program).get("train_stage")
  if train_stage is None:
    return "StandardRLProgram has no train_stage of its own"
  try:
    found = probing.fingerprint(train_stage)
  except OSError as e:
    return (f"its source is not available ({e}), so it cannot be checked against the body the "
            "plugin's staged loop reproduces")
  accepted = t.config.accept_train_stage
  if found in (TRAIN_STAGE_FINGERPRINT, accepted):
    return None
  other = f" ({ACCEPT.env}={accepted} accepts another body)" if accepted else ""
  return (f"fingerprint {found} differs from tunix {TRAIN_STAGE_COMMIT}'s "
          f"{TRAIN_STAGE_FINGERPRINT}, the body the plugin's staged loop reproduces and would "
          f"replace{other}; upgrade tunix-stage-plugin, or check that the staged loop still does "
          f"what this body does (docs/tunix.md) and set {ACCEPT.env}={found}")


# One row per probe: its name, then what it checks, on which of the Tunix classes, in order; the
# first check that does not hold gives the probe's refusal line.
PROBES: tuple[tuple[str, tuple[probing.Check, ...]], ...] = (
    ("server: RemoteExecutionServer.execute_request routing", (
        has_method("base_server", "execute_request", params=("request",), coroutine=True,
                   own=True),
        has_method("base_server", "execute_sync_request", params=("request",), coroutine=False),
        that(lambda t: isinstance(inspect.getattr_static(t.base_server, "bound_instance"),
                                  property), "bound_instance is not a property"),
        that(lambda t: issubclass(t.server, t.base_server)
             and "execute_request" not in vars(t.server),
             "GrpcRemoteExecutionServer overrides execute_request"),
        has_method("server", "stop_serving", params=(), coroutine=True, own=True),
        is_free("base_server"),
        is_free("server"))),
    # The stream's handler joins the grpc server start_serving_async assigns to self._server
    # (before it starts).
    ("server: a chunked stream beside GrpcRemoteExecutionServer's methods", (
        has_method("server", "start_serving_async", params=("port",), coroutine=True, own=True),
        that(lambda t: probing.Body(t.server.start_serving_async).assigns("self._server"),
             "GrpcRemoteExecutionServer.start_serving_async does not assign self._server"),
        that(lambda t: "_server" not in vars(t.server),
             "GrpcRemoteExecutionServer has a class attribute _server"),
        that(lambda t: isinstance(t.remote._MAX_MESSAGE_BYTES, int),  # pylint: disable=protected-access
             "remote_execution._MAX_MESSAGE_BYTES is not an int"),
        that(lambda t: callable(t.remote._grpc_options),  # pylint: disable=protected-access
             "remote_execution._grpc_options is missing"),
        that(_stream_handle, "GrpcRemoteActorHandle keeps no target_address / _rpc_timeout_s"),
        that(lambda t: "payload" in _params(t.remote.ExecutionResponse.deserialize),
             "ExecutionResponse.deserialize(payload) is missing"),
        that(lambda t: {"request_id", "method_name", "args", "kwargs"}
             <= set(_params(t.remote.ExecutionRequest.__init__)),
             "ExecutionRequest.__init__ lacks request_id/method_name/args/kwargs"))),
    ("worker: TrainerWorker.fwd_bwd(payload, **kwargs)", (
        has_method("worker", contract.FWD_BWD, params=("payload",), coroutine=False,
                   var_kwargs=True, own=True),
        has_method("worker", "_response", params=(), coroutine=False, var_kwargs=True),
        is_free("worker", contract.STAGE_BATCH, contract.RESET_STAGED))),
    # fwd_bwd must prepare through the seam (inline and staged are then the same computation).
    ("trainer: PeftTrainer.fwd_bwd prepares through _prepare_payload(payload)", (
        has_method("peft", "_prepare_payload", params=("payload",), coroutine=False, own=True),
        has_method("peft", "fwd_bwd", params=("payload",), coroutine=False, own=True),
        that(lambda t: bool(probing.Body(t.peft.fwd_bwd).calls("self._prepare_payload")),
             "PeftTrainer.fwd_bwd does not call self._prepare_payload"))),
    ("server: RemoteExecutionError [type] envelope", (error_envelope,)),
    ("engine: DistributedRLEngine.train_step(**kwargs) / _invoke_worker", (
        has_method("engine", "train_step", params=("payload", "role", "accumulate_gradients",
                                                    "apply_optimizer"),
                   coroutine=True, var_kwargs=True),
        has_method("engine", "_invoke_worker", params=("worker", "method_name"), coroutine=True,
                   var_kwargs=True),
        has_method("engine", "per_token_logps", params=("role", "items"), coroutine=True),
        has_method("engine", "sync_weights", params=("role",), coroutine=True),
        is_free("engine", "stage_train_batch", "reset_staged_batches"))),
    ("program: StandardRLProgram.train_stage / RLStepResult", (
        has_method("program", "train_stage", params=("engine", "num_steps"), coroutine=True,
                   own=True),
        has_all("StandardRLProgram.__init__", lambda t: _params(t.program.__init__),
                ("algo", "assembler", "mini_batch_size", "max_staleness", "sync_weights",
                 "on_step_begin", "on_step_end")),
        has_all("RLStepResult", lambda t: {f.name for f in dataclasses.fields(t.result)},
                sorted(STEP_RESULT_FIELDS)),
        is_free("program", "_stage_ahead_while_pending", "_prestage_across_boundary"))),
)

# The train loop's probe on a tunix without the seam: train_stage's body, by its fingerprint (the
# seam's: loop_seam.PROBE).
COPY_PROBE: tuple[str, tuple[probing.Check, ...]] = (
    "program: StandardRLProgram.train_stage's body", (program_body,))
