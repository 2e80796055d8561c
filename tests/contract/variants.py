"""Every attention variant of jaxtopk, behind one calling convention.

A variant is ONE line of ``VARIANTS``: its name, a builder ``build(policy,
dtype) -> fn(q, k, v, mask, bias) -> (output, certificate)`` in the jax.nn
layout of ``families`` (q ``[B, T, H, D]``, k ``[B, N, HK, D]``, v ``[B, N,
HK, E]``, mask ``[B, 1, T, N]`` bool or None, bias ``[B, H, T, N]`` or
None; output ``[B, T, H, E]``, Certificate ``[B, T, H]``), and what it takes:

- ``bias``: whether it takes an additive bias (a variant that does not is
  never given one: that input is not part of its signature);
- ``masks``: 'any' (per-row masks) or 'padding' (key-padding masks only; a
  per-row mask must be REFUSED with an error naming the mask);
- ``grad``: whether gradients flow (prefill paths);
- ``supports``: the policy features it honours; every other policy must be
  refused with an error naming the field (``Policy.require``);
- ``effective``: optional map from the inputs to what the attention core
  really receives (the Flax layers project q, k, v: identity projections
  here, which XLA on CPU computes with subnormals flushed), for the
  reference.

Decode variants attend one query per sequence: row (b, t) becomes batch row
b * T + t with its own cache holding that row's real keys first (a KVCache
has a filled prefix, so a row's mask becomes a permutation and a length;
values travel with their keys, so the identity columns still name the
original keys).
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxtopk
from jaxtopk import parallel
from jaxtopk.selection import FEATURES
from jaxtopk.selection import Certified
from jaxtopk.selection import capabilities
from tests.contract import families as fam
from tests.contract import policies as pol

ALL = FEATURES
BOX = ALL - {"bound=lowrank"}


@dataclasses.dataclass(frozen=True)
class Variant:
  """One attention variant (see the module docstring)."""

  name: str
  build: Callable
  kind: str = "prefill"
  bias: bool = True
  masks: str = "any"
  grad: bool = True
  supports: frozenset = ALL
  effective: Callable | None = None
  head_dim: int = fam.D  # q/k head dim the path sees (sets the scale)

  @property
  def scale(self) -> float:
    """The logit scale the variant uses (the default 1/sqrt(head_dim))."""
    return float(1.0 / np.sqrt(self.head_dim))


def _prefill(implementation):
  def build(policy, dtype):
    def fn(q, k, v, mask, bias):
      return jaxtopk.topk_attention(
        q,
        k,
        v,
        policy=policy,
        mask=mask,
        bias=bias,
        implementation=implementation,
      )

    return fn

  return build


def _rows_first(k, v, mask):
  """Per row (b, t): keys/values with the row's real keys first, lengths.

  Returns k ``[B * T, N, HK, D]``, v ``[B * T, N, HK, E]``, length
  ``[B * T]``.
  """
  b, n = k.shape[0], k.shape[1]
  t = fam.T
  real = jnp.ones((b, t, n), bool) if mask is None else mask[:, 0]
  order = jnp.argsort(~real, axis=-1, stable=True)  # real keys first
  bi = jnp.arange(b)[:, None, None]
  kk = k[bi, order].reshape(b * t, n, *k.shape[2:])
  vv = v[bi, order].reshape(b * t, n, *v.shape[2:])
  return kk, vv, jnp.sum(real, axis=-1).reshape(b * t)


def _block(policy) -> int:
  return policy.block_size if isinstance(policy, Certified) else pol.BLOCK


def _decode(implementation):
  def build(policy, dtype):
    bs = _block(policy)

    def fn(q, k, v, mask, bias):
      del bias
      b, t, h, d = q.shape
      n, hk, e = k.shape[1], k.shape[2], v.shape[3]
      kk, vv, length = _rows_first(k, v, mask)
      max_len = -(-n // bs) * bs
      cache = jaxtopk.init_kv_cache(
        b * t, max_len, hk, d, block_size=bs, dtype=k.dtype, value_dim=e
      )
      cache = jaxtopk.kv_cache_update(cache, kk, vv, num_steps=length)
      out, cert = jaxtopk.decode_attention(
        q.reshape(b * t, 1, h, d),
        cache,
        policy=policy,
        implementation=implementation,
        key=jax.random.key(0),
      )
      out = out.reshape(b, t, h, e)
      cert = jax.tree.map(lambda x: x.reshape(b, t, h), cert)
      return out, cert

    return fn

  return build


def _split(x, n_shards, axis):
  """``axis`` split into contiguous shards, stacked first."""
  shape = x.shape
  x = x.reshape(
    *shape[:axis], n_shards, shape[axis] // n_shards, *shape[axis + 1 :]
  )
  return jnp.moveaxis(x, axis, 0)


def _kv_sharded(n_shards):
  """kv_shard_attention with the keys split over a vmapped axis."""

  def build(policy, dtype):
    def fn(q, k, v, mask, bias):
      b, t, h, d = q.shape
      n, hk = k.shape[1], k.shape[2]
      g = h // hk
      pad = -(-n // n_shards) * n_shards - n  # pad keys to a multiple
      # Head-major with the g query heads of a kv head as rows (GQA).
      qh = q.reshape(b, t, hk, g, d).transpose(0, 2, 3, 1, 4)
      qh = qh.reshape(b, hk, g * t, d)
      kh = jnp.pad(jnp.swapaxes(k, 1, 2), ((0, 0), (0, 0), (0, pad), (0, 0)))
      vh = jnp.pad(jnp.swapaxes(v, 1, 2), ((0, 0), (0, 0), (0, pad), (0, 0)))
      valid = jnp.ones((b, 1, t, n), bool) if mask is None else mask
      valid = jnp.broadcast_to(valid[:, :, None], (b, 1, g, t, n))
      valid = jnp.broadcast_to(valid, (b, hk, g, t, n)).reshape(b, hk, g * t, n)
      valid = jnp.pad(valid, ((0, 0), (0, 0), (0, 0), (0, pad)))
      bh = None
      if bias is not None:
        bh = bias.reshape(b, hk, g, t, n).reshape(b, hk, g * t, n)
        bh = jnp.pad(bh, ((0, 0), (0, 0), (0, 0), (0, pad)))

      def shard(kk, vv, mm, bb):
        return parallel.kv_shard_attention(
          qh,
          kk,
          vv,
          mm,
          bias=bb,
          policy=policy,
          scale=1.0 / np.sqrt(d),
          axis_name="kv",
          n_total=n + pad,
        )

      out, cert = jax.vmap(
        shard, in_axes=(0, 0, 0, None if bh is None else 0), axis_name="kv"
      )(
        _split(kh, n_shards, 2),
        _split(vh, n_shards, 2),
        _split(valid, n_shards, 3),
        None if bh is None else _split(bh, n_shards, 3),
      )
      out, cert = jax.tree.map(lambda x: x[0], (out, cert))  # shard 0

      def to_bth(x):  # [b, hk, g * t, ...] -> [b, t, h, ...]
        x = x.reshape(b, hk, g, t, *x.shape[3:])
        return jnp.moveaxis(x, 3, 1).reshape(b, t, h, *x.shape[4:])

      return to_bth(out), jax.tree.map(to_bth, cert)

    return fn

  return build


def _sharded_decode(n_shards):
  """The sharded decode step with the cache split over a vmapped axis."""

  def build(policy, dtype):
    bs = _block(policy)

    def fn(q, k, v, mask, bias):
      del bias
      b, t, h, d = q.shape
      n, hk, e = k.shape[1], k.shape[2], v.shape[3]
      kk, vv, length = _rows_first(k, v, mask)
      max_len = -(-n // (bs * n_shards)) * bs * n_shards
      cache = jaxtopk.init_kv_cache(
        b * t, max_len, hk, d, block_size=bs, dtype=k.dtype, value_dim=e
      )
      cache = jaxtopk.kv_cache_update(cache, kk, vv, num_steps=length)

      def shard(keys, values):
        return parallel.decode_shard_attention(
          q.reshape(b * t, 1, h, d),
          keys,
          values,
          cache.length,
          policy=policy,
          scale=1.0 / np.sqrt(d),
          axis_name="kv",
          n_total=max_len,
          block_norms=cache.vnorm,
          block_size=bs,
        )

      out, cert = jax.vmap(shard, axis_name="kv")(
        _split(cache.keys, n_shards, 2), _split(cache.values, n_shards, 2)
      )
      out, cert = jax.tree.map(lambda x: x[0], (out, cert))  # shard 0
      out = out.reshape(b, t, h, e)
      cert = jax.tree.map(lambda x: x.reshape(b, t, h), cert)
      return out, cert

    return fn

  return build


def _eye_init(key, shape, dtype=jnp.float32):
  """Identity LinearGeneral kernel: flattened inputs -> flattened outputs."""
  del key
  shape = tuple(shape)
  for split in range(1, len(shape)):
    n_in = int(np.prod(shape[:split]))
    if n_in == int(np.prod(shape[split:])):
      return jnp.asarray(np.eye(n_in).reshape(shape), dtype)
  raise ValueError(f"no identity kernel of shape {shape}")


def _layer_inputs(q, k, v):
  """q, k zero-padded to E columns; flattened [b, len, heads * E] inputs."""
  e = v.shape[-1]
  pad = ((0, 0), (0, 0), (0, 0), (0, e - q.shape[-1]))
  q, k = jnp.pad(q, pad), jnp.pad(k, pad)
  return tuple(x.reshape(*x.shape[:2], -1) for x in (q, k, v))


def _layer_effective(q, k, v):
  """What the attention core of the identity-projected layers sees.

  The projections run on XLA (CPU: subnormal inputs read as 0); q and k
  are zero-padded to E columns, which changes no logit.
  """
  xq, xk, xv = _layer_inputs(*(jnp.asarray(x) for x in (q, k, v)))

  def eye(x):
    return jnp.einsum("bli,ij->blj", x, jnp.eye(x.shape[-1], dtype=x.dtype))

  b, t, h, _ = q.shape
  n, hk, e = k.shape[1], k.shape[2], v.shape[3]
  qe = np.asarray(eye(xq)).reshape(b, t, h, e)
  ke = np.asarray(eye(xk)).reshape(b, n, hk, e)
  ve = np.asarray(eye(xv)).reshape(b, n, hk, e)
  return qe, ke, ve


def _mha_kwargs(dtype):
  return dict(
    num_heads=fam.H,
    in_features=fam.H * fam.E,
    qkv_features=fam.H * fam.E,
    out_features=fam.H * fam.E,
    num_kv_heads=fam.HK,
    in_kv_features=fam.HK * fam.E,
    use_bias=False,
    kernel_init=_eye_init,
    dtype=jnp.dtype(dtype),
    decode=False,
    rngs=nnx.Rngs(0),
  )


def _flax_layer(policy, dtype):
  layer = jaxtopk.nn.CertifiedTopKAttention(policy=policy, **_mha_kwargs(dtype))
  graphdef, state = nnx.split(layer)

  # The module state is an ARGUMENT of a jitted function (not a closure):
  # the layer records its certificate in a Variable, which Flax lets a
  # function mutate only at the trace level where the module was built.
  @jax.jit
  def apply(state, q, k, v, mask):
    xq, xk, xv = _layer_inputs(q, k, v)
    m = nnx.merge(graphdef, state)
    y = m(xq, xk, xv, mask=mask)
    return y.reshape(*q.shape[:3], -1), m.last_certificate.get_value()

  def fn(q, k, v, mask, bias):
    del bias
    return apply(state, q, k, v, mask)

  return fn


def _attention_fn(policy, dtype):
  layer = nnx.MultiHeadAttention(
    attention_fn=jaxtopk.nn.topk_attention_fn(policy), **_mha_kwargs(dtype)
  )
  graphdef, state = nnx.split(layer)

  @jax.jit
  def apply(state, q, k, v, mask):  # state: an argument (see _flax_layer)
    xq, xk, xv = _layer_inputs(q, k, v)
    m = nnx.merge(graphdef, state)
    forward = nnx.capture(m, nnx.Intermediate)
    y, captured = forward(xq, xk, xv, mask=mask, sow_weights=True)
    certs = jaxtopk.nn.collect_certificates(captured)
    (cert,) = certs.values()
    return y.reshape(*q.shape[:3], -1), cert

  def fn(q, k, v, mask, bias):
    del bias
    return apply(state, q, k, v, mask)

  return fn


_PALLAS_PREFILL = capabilities(
  "policy=Dense", "policy=Certified", "search=exact", "max_topk"
)
_PALLAS_DECODE = capabilities(
  "policy=Dense", "policy=Certified", "search=delta", "bound=box", "max_topk"
)
# The XLA prefill (and the Flax layer / attention_fn on it) refuses the
# low-rank and key-code bounds by name (topk_attention docstring: no cache
# keeps codes there).
_XLA_PREFILL = ALL - {"bound=lowrank", "bound=codes", "search=mc"}
_SHARDED = ALL - {
  "search=delta",
  "search=mc",
  "bound=box",
  "bound=lowrank",
  "bound=codes",
}

# THE list: a variant joins by adding one line.
VARIANTS = (
  Variant("xla_prefill", _prefill(None), supports=_XLA_PREFILL),
  Variant(
    "xla_decode",
    _decode(None),
    kind="decode",
    bias=False,
    grad=False,
    supports=BOX,
  ),
  Variant(
    "pallas_prefill",
    _prefill("pallas"),
    bias=False,
    masks="padding",
    supports=_PALLAS_PREFILL,
  ),
  Variant(
    "pallas_decode",
    _decode("pallas"),
    kind="decode",
    bias=False,
    grad=False,
    supports=_PALLAS_DECODE,
  ),
  Variant("kv_sharded", _kv_sharded(3), supports=_SHARDED),
  Variant(
    "sharded_decode",
    _sharded_decode(2),
    kind="decode",
    bias=False,
    grad=False,
    supports=_SHARDED,
  ),
  Variant(
    "flax_layer",
    _flax_layer,
    bias=False,
    effective=_layer_effective,
    head_dim=fam.E,
    supports=_XLA_PREFILL,
  ),
  Variant(
    "attention_fn",
    _attention_fn,
    bias=False,
    effective=_layer_effective,
    head_dim=fam.E,
    supports=_XLA_PREFILL,
  ),
)

BY_NAME = {v.name: v for v in VARIANTS}


@functools.cache
def compiled(variant_name: str, policy_name: str, dtype_name: str):
  """``jax.jit`` of the variant for one policy and dtype (compiled once)."""
  v = BY_NAME[variant_name]
  fn = v.build(pol.BY_NAME[policy_name], fam.DTYPES[dtype_name])
  return jax.jit(fn)


@functools.cache
def eager(variant_name: str, policy_name: str, dtype_name: str):
  """The variant for one policy and dtype, called without an outer jit."""
  v = BY_NAME[variant_name]
  return v.build(pol.BY_NAME[policy_name], fam.DTYPES[dtype_name])
