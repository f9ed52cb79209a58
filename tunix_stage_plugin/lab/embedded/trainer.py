"""A small decoder language model trained with optax on a device mesh (trainer process only).

`fwd_bwd` adds one micro-batch's gradients to an accumulator and `update` applies their mean with
optax, as tunix's trainer does across a step's micro-batches. Every call blocks until the device is
done, so the caller can time device compute exactly.

Set XLA_FLAGS / JAX_PLATFORMS before importing this module (trainer_main does): JAX reads them once.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tunix_stage_plugin.lab.embedded import data as data_lib

DATA_AXIS = "data"


def init_params(sizes: data_lib.Sizes, seed: int) -> dict[str, Any]:
  keys = iter(jax.random.split(jax.random.key(seed), 2 + 4 * sizes.layers))
  d = sizes.d_model

  def dense(n_in: int, n_out: int) -> jax.Array:
    return jax.random.normal(next(keys), (n_in, n_out), jnp.float32) * n_in ** -0.5

  params = {"embed": jax.random.normal(next(keys), (sizes.vocab, d), jnp.float32) * 0.02,
            "pos": jax.random.normal(next(keys), (sizes.seq, d), jnp.float32) * 0.02,
            "layers": []}
  for _ in range(sizes.layers):
    params["layers"].append({
        "ln1": jnp.ones(d), "qkv": dense(d, 3 * d), "out": dense(d, d),
        "ln2": jnp.ones(d), "up": dense(d, 4 * d), "down": dense(4 * d, d),
    })
  return params


def _norm(x: jax.Array, gain: jax.Array) -> jax.Array:
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * gain


def logits(sizes: data_lib.Sizes, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
  b, t = tokens.shape
  h, dh = sizes.heads, sizes.d_model // sizes.heads
  x = params["embed"][tokens] + params["pos"][None, :t]
  causal = jnp.tril(jnp.ones((t, t), bool))
  for layer in params["layers"]:
    q, k, v = jnp.split(_norm(x, layer["ln1"]) @ layer["qkv"], 3, axis=-1)
    q, k, v = (y.reshape(b, t, h, dh) for y in (q, k, v))
    scores = jnp.where(causal, jnp.einsum("bqhd,bkhd->bhqk", q, k) * dh ** -0.5, -1e9)
    attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, -1)
    x = x + attn @ layer["out"]
    x = x + jax.nn.gelu(_norm(x, layer["ln2"]) @ layer["up"]) @ layer["down"]
  return x @ params["embed"].T


def loss(sizes: data_lib.Sizes, params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
  tokens = batch["tokens"]
  logp = jax.nn.log_softmax(logits(sizes, params, tokens)[:, :-1])
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  if sizes.payload == data_lib.PAYLOAD_RL:
    # Every field reaches the parameters (a corrupted transfer changes the digest): the loss
    # mask selects tokens; advantages, the log-prob gap, routing, positions and segments weight
    # them a little.
    mask = batch["loss_mask"].astype(jnp.float32)[:, 1:]
    routed = batch["routed_experts"].astype(jnp.float32).mean((-1, -2))
    signal = (batch["advantages"][:, None] + batch["old_logprobs"] - batch["ref_logprobs"]
              + 0.01 * routed + 0.001 * (batch["positions"] + batch["segment_ids"]))
    weights = mask * (1.0 + 0.01 * jnp.tanh(signal)[:, 1:])
    return (nll * weights).sum() / jnp.maximum(mask.sum(), 1.0)
  # Per-token weights from the ballast: every payload byte reaches the parameters.
  weights = 1.0 + 0.01 * jnp.tanh(batch["ballast"].mean(-1) - 0.5)[:, 1:]
  return (nll * weights).mean()


def params_digest(params: Any) -> str:
  """sha256 over every parameter's path, dtype, shape and bytes, in tree order: equal digests,
  the same parameters bit for bit."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    value = np.asarray(leaf)
    h.update(f"{jax.tree_util.keystr(path)}:{value.dtype}:{value.shape};".encode())
    h.update(value.tobytes())
  return h.hexdigest()


@functools.lru_cache(maxsize=8)
def _compiled(sizes: data_lib.Sizes, learning_rate: float
              ) -> tuple[Any, Any, optax.GradientTransformation]:
  """Jitted step functions per size: a state reset re-initialises arrays, never recompiles."""
  optimizer = optax.adamw(learning_rate)

  @jax.jit
  def fwd_bwd(params, grads, batch):
    value, g = jax.value_and_grad(functools.partial(loss, sizes))(params, batch)
    return value, jax.tree.map(jnp.add, grads, g)

  @jax.jit
  def update(params, opt_state, grads, count):
    mean = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = optimizer.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.tree.map(jnp.zeros_like, grads)

  return fwd_bwd, update, optimizer


class Trainer:
  """Parameters replicated and micro-batches split along the batch on a 1-D mesh of all devices."""

  def __init__(self, sizes: data_lib.Sizes, seed: int, *, learning_rate: float = 1e-3) -> None:
    devices = jax.devices()
    if sizes.batch % len(devices):
      raise ValueError(f"batch {sizes.batch} must be a multiple of the device count {len(devices)}")
    self.sizes = sizes
    self.mesh = Mesh(np.array(devices), (DATA_AXIS,))
    self._replicated = NamedSharding(self.mesh, PartitionSpec())
    self._split = NamedSharding(self.mesh, PartitionSpec(DATA_AXIS))
    self._fwd_bwd, self._update, optimizer = _compiled(sizes, learning_rate)
    self.params = jax.device_put(init_params(sizes, seed), self._replicated)
    self.opt_state = jax.device_put(optimizer.init(self.params), self._replicated)
    self.grads = jax.tree.map(jnp.zeros_like, self.params)
    self.accumulated = 0
    self.updates = 0

  @property
  def platform(self) -> str:
    """The devices' backend: cpu, gpu, tpu."""
    return self.mesh.devices.flat[0].platform

  def device_bytes_in_use(self) -> int | None:
    """Bytes the mesh's devices hold now (the allocator's figure; None where the backend does not
    keep one, as on CPU)."""
    stats = [d.memory_stats() for d in self.mesh.devices.flat]
    if any(s is None or "bytes_in_use" not in s for s in stats):
      return None
    return sum(s["bytes_in_use"] for s in stats)

  def device_peak_bytes(self) -> int | None:
    """The allocator's peak since the process started (None where not kept)."""
    stats = [d.memory_stats() for d in self.mesh.devices.flat]
    if any(s is None or "peak_bytes_in_use" not in s for s in stats):
      return None
    return sum(s["peak_bytes_in_use"] for s in stats)

  def place(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Host to device (the real part; the emulated bandwidth is the caller's). Blocks until done."""
    expected = self.sizes.array_shapes()
    shapes = {k: tuple(v.shape) for k, v in arrays.items()}
    if shapes != expected:
      raise ValueError(f"micro-batch arrays {shapes} do not match the model's sizes; "
                       f"accepted: {expected}")
    placed = jax.device_put(arrays, {k: self._split for k in arrays})
    return jax.block_until_ready(placed)

  def fwd_bwd(self, placed: dict[str, jax.Array]) -> float:
    value, self.grads = self._fwd_bwd(self.params, self.grads, placed)
    self.accumulated += 1
    return float(value)  # waits for the device

  def update(self) -> int:
    if self.accumulated == 0:
      raise RuntimeError("update called with no accumulated gradients (call fwd_bwd first)")
    self.params, self.opt_state, self.grads = self._update(
        self.params, self.opt_state, self.grads, jnp.float32(self.accumulated))
    jax.block_until_ready(self.params)
    self.accumulated = 0
    self.updates += 1
    return self.updates

  def digest(self) -> str:
    return params_digest(self.params)
