"""Top-k attention on the XLA path, returning (output, Certificate).

THEORY 1 (one row), 6.5 (every call certified), 8.1/8.2 (Top-k prefill and
training). Arguments and layout as ``jax.nn.dot_product_attention`` (a
drop-in: bias and mask positional, unbatched 3-D inputs, sequence lengths,
local windows, the log-sum-exp residual): query
``[batch, q_len, num_heads, head_dim]``, key/value
``[batch, kv_len, num_kv_heads, head_dim]`` with ``num_heads`` a multiple of
``num_kv_heads`` (GQA). The XLA implementation is the blockwise prefill of
``_prefill`` (query tiles against key blocks; it never materialises the
``[q_len, kv_len]`` logits of the whole call and skips key blocks certified
negligible under Delta-Search).

The kept set is chosen on stop-gradient logits (it is piecewise constant);
gradients flow through the softmax over the kept keys (THEORY 8.2).

Paths are ops of the one registry (``attention.registry``): this module
registers 'xla_prefill'; ``jaxtopk.kernels`` and ``jaxtopk.parallel``
register theirs. Every argument is checked here (``attention.checks``)
before any op runs; ``implementation=`` (a name or a sequence tried in
order) chooses the op, and an op refuses by name what it cannot do.
"""

import functools
from collections.abc import Callable
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxtopk.attention import _prefill
from jaxtopk.attention import checks
from jaxtopk.attention import registry
from jaxtopk.selection import Certificate
from jaxtopk.selection import Policy
from jaxtopk.selection import core
from jaxtopk.selection.internal import FEATURES

# ``{implementation name: fn}`` of the registered prefill ops (read-only,
# from ``registry.OPS``; None is the default).
IMPLEMENTATIONS = registry.ImplementationView("prefill")

# The name of this path in capability errors.
BACKEND = "topk_attention(implementation='xla')"


def register_implementation(name: str, fn: Callable) -> None:
  """Plugs a backend into ``topk_attention`` (an op of ``attention.registry``).

  Kept for compatibility: the op declares every policy feature and argument,
  so ``fn`` itself refuses (raising ``UnsupportedPolicyError`` or
  NotImplementedError naming the field) what it cannot honour; registering
  an ``registry.AttentionOp`` declares that instead.

  Args:
    name: the value users pass as ``implementation=``.
    fn: callable ``fn(query, key, value, *, policy, mask, bias, is_causal,
      scale, query_seq_lengths, key_value_seq_lengths, local_window_size,
      values_bound, return_residual) -> (output, Certificate, lse)`` with
      the layout and semantics of ``topk_attention`` on batched inputs
      (arguments already checked; ``scale`` a Python float, or a 0-d array
      for a traced scale; ``local_window_size`` None or ``(left, right)``;
      ``lse`` None unless ``return_residual``). It raises naming any
      argument it cannot honour.
  """
  registry.register(
    registry.AttentionOp(
      name=f"{name}_prefill",
      implementation=name,
      kind="prefill",
      fn=fn,
      label=f"topk_attention(implementation={name!r})",
      supports=FEATURES,
      arguments=registry.PREFILL_ARGUMENTS,
    )
  )


def causal_mask(q_len: int, kv_len: int) -> jax.Array:
  """``[q_len, kv_len]`` bool, True where key j <= query i.

  Same alignment as ``jax.nn.dot_product_attention(is_causal=True)``
  (top-left: query i sees keys 0..i).
  """
  return jnp.tril(jnp.ones((q_len, kv_len), bool))


@functools.partial(
  jax.jit,
  static_argnames=(
    "policy",
    "is_causal",
    "static_scale",
    "window",
    "values_bound",
    "block_sizes",
    "return_lse",
    "return_keep",
  ),
)
def _xla(
  query,
  key,
  value,
  mask,
  bias,
  dynamic_scale,
  q_lens,
  kv_lens,
  *,
  policy,
  is_causal,
  static_scale,
  window,
  values_bound,
  block_sizes,
  return_lse,
  return_keep,
):
  if static_scale is not None:
    scale, scale_ok = static_scale, True
  else:
    scale, scale_ok = dynamic_scale, checks.scale_ok(dynamic_scale)
  return _prefill.blockwise_attention(
    query,
    key,
    value,
    policy=policy,
    mask=mask,
    bias=bias,
    is_causal=is_causal,
    scale=scale,
    scale_ok=scale_ok,
    q_lens=q_lens,
    kv_lens=kv_lens,
    window=window,
    values_bound=values_bound,
    block_sizes=block_sizes,
    return_lse=return_lse,
    return_keep=return_keep,
  )


def _call_xla(
  query,
  key,
  value,
  *,
  scale,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size=None,
  **kw,
):
  static = scale if isinstance(scale, float) else None
  dynamic = None if static is not None else scale
  return _xla(
    query,
    key,
    value,
    kw.pop("mask"),
    kw.pop("bias"),
    dynamic,
    query_seq_lengths,
    key_value_seq_lengths,
    static_scale=static,
    window=local_window_size,
    **kw,
  )


def xla_topk_attention_with_keep(
  query,
  key,
  value,
  *,
  policy,
  mask=None,
  bias=None,
  is_causal=False,
  scale=None,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size=None,
  values_bound=True,
  block_sizes=None,
) -> tuple[jax.Array, Certificate, jax.Array]:
  """``topk_attention`` (XLA) that also returns the kept set.

  For tests and analysis at small sizes: the kept set is as large as the
  logits. Batched inputs only.

  Returns:
    ``(output, certificate, keep)`` with ``keep`` ``[batch, num_heads,
    q_len, kv_len]`` bool (head-major).
  """
  args = _checked(query, key, value, policy, mask, bias, is_causal, scale)
  query, key, value, dims, mask, bias, is_causal, scale = args
  lens = _checked_lengths(query_seq_lengths, key_value_seq_lengths, dims)
  window = checks.check_window(local_window_size)
  checks.check_policy(policy, BACKEND, _prefill.SUPPORTS)
  if dims.empty:
    out, cert = checks.empty_result(
      dims, query.dtype, values_bound=values_bound
    )
    return out, cert, jnp.zeros(dims.logits_shape, bool)
  out, cert, _, keep = _call_xla(
    query,
    key,
    value,
    policy=policy,
    mask=mask,
    bias=bias,
    is_causal=is_causal,
    scale=scale,
    query_seq_lengths=lens[0],
    key_value_seq_lengths=lens[1],
    local_window_size=window,
    values_bound=values_bound,
    block_sizes=block_sizes,
    return_lse=False,
    return_keep=True,
  )
  return out, cert, keep


def xla_topk_attention(
  query,
  key,
  value,
  *,
  policy,
  mask=None,
  bias=None,
  is_causal=False,
  scale=None,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size=None,
  values_bound=True,
  return_residual=False,
  block_sizes=None,
):
  """The XLA implementation of ``topk_attention`` (checked arguments).

  ``block_sizes`` (``attention._prefill.BlockSizes``) tunes the tiling.

  Returns:
    ``(output, certificate, lse)``, ``lse`` None unless ``return_residual``.
  """
  checks.check_policy(policy, BACKEND, _prefill.SUPPORTS)
  if scale is None:
    scale = checks.check_scale(None, query.shape[-1])
  out, cert, lse, _ = _call_xla(
    query,
    key,
    value,
    policy=policy,
    mask=mask,
    bias=bias,
    is_causal=is_causal,
    scale=scale,
    query_seq_lengths=query_seq_lengths,
    key_value_seq_lengths=key_value_seq_lengths,
    local_window_size=local_window_size,
    values_bound=values_bound,
    block_sizes=block_sizes,
    return_lse=return_residual,
    return_keep=False,
  )
  return out, cert, lse


XLA_PREFILL = registry.register(
  registry.AttentionOp(
    name="xla_prefill",
    implementation="xla",
    kind="prefill",
    fn=xla_topk_attention,
    label=BACKEND,
    supports=_prefill.SUPPORTS,
    arguments=registry.PREFILL_ARGUMENTS,
  )
)


def _checked(query, key, value, policy, mask, bias, is_causal, scale):
  """Every argument checked (``attention.checks``), same under jit."""
  checks.check_policy(policy)
  query, key, value, dims = checks.check_qkv(query, key, value)
  mask = checks.check_mask(mask, dims.logits_shape)
  bias = checks.check_bias(bias, dims.logits_shape)
  is_causal = checks.check_is_causal(is_causal)
  scale = checks.check_scale(scale, dims.head_dim)
  return query, key, value, dims, mask, bias, is_causal, scale


def _checked_lengths(q_lens, kv_lens, dims, unbatched=False):
  """Both sequence-length arguments checked (``checks.check_seq_lengths``)."""
  return (
    checks.check_seq_lengths(q_lens, "query_seq_lengths", dims, unbatched),
    checks.check_seq_lengths(kv_lens, "key_value_seq_lengths", dims, unbatched),
  )


def _batched(query, key, value):
  """Whether the call is batched (4-d) or unbatched (3-d); ranks checked."""
  ranks = tuple(jnp.ndim(x) for x in (query, key, value))
  if ranks == (3, 3, 3):
    return False
  if ranks == (4, 4, 4):
    return True
  raise ValueError(
    "query, key and value must all be [batch, seq, heads, head_dim] or all"
    f" unbatched [seq, heads, head_dim]; got shapes {jnp.shape(query)},"
    f" {jnp.shape(key)} and {jnp.shape(value)}"
  )


def topk_attention(
  query,
  key,
  value,
  bias=None,
  mask=None,
  *,
  scale=None,
  is_causal: bool = False,
  query_seq_lengths=None,
  key_value_seq_lengths=None,
  local_window_size: int | tuple[int, int] | None = None,
  implementation: str | Sequence[str] | None = None,
  return_residual: bool = False,
  policy: Policy,
  values_bound: bool = True,
) -> tuple[jax.Array, Certificate] | tuple[jax.Array, jax.Array, Certificate]:
  """Attention over the kept keys of each row, with a Certificate.

  A drop-in for ``jax.nn.dot_product_attention`` (same arguments, in the
  same places, with the same meanings) that also takes a selection
  ``policy`` and returns a Certificate. THEORY 6.5 and 8.1/8.2. For every
  query row and head, ``policy`` chooses the kept keys H from the logits
  s = scale q.k + bias over the real keys, and the output is softmax over H
  times the values (P_hat of THEORY 1). The real keys of a row are those
  its mask, ``is_causal``, ``local_window_size`` and the sequence lengths
  all let it see: each of these is a mask (a key it hides is not a key of
  the row, in the output and in the certificate alike); a -inf logit is a
  key of zero mass. The certificate bounds TV(P, P_hat) = tau, rounded up
  for the float rounding of the logits themselves (THEORY 10), and
  (``values_bound``) ||Attn - Attn_k||_2 by THEORY 4.2/4.4. With ``Dense()``
  (or any policy that keeps every key) this equals
  ``jax.nn.dot_product_attention``, except on a row with no real key (jax
  averages the values there; this returns zeros and an invalid row).

  The XLA path (``implementation=None`` or 'xla') is blockwise
  (``attention._prefill``): memory O(block_q x kv_len) per query tile, never
  the ``[q_len, kv_len]`` logits of the whole call (a window or causal mask
  also skips the key blocks no row of a tile can see). Which keys it keeps:

  - ``Dense``, ``FixedK``, ``Ratio``, ``PowerLaw``: every key is scored; the
    kept set is that of ``jaxtopk.select`` on the logits (the ``topk``
    largest, ties broken by increasing key index).
  - ``Certified(eps)`` (search ``Exact``): every key is scored; the fewest
    keys whose dropped mass is certified <= eps (all keys tied at the
    threshold are kept), capped at ``max_topk``, up to the keys within one
    bin of a one-pass histogram (``threshold.COARSE_BINS``; ~0.05 logit at
    1,024 keys and eps 0.05): every scored key's value is multiplied
    anyway, so a finer threshold would cost time and save none.
  - ``Certified(eps, 'delta')``: Delta-Search at query-tile granularity
    (THEORY 6.2): key blocks of ``block_size`` are scored in order of their
    box bound (THEORY 3.3) until the unscored mass fits the budget; blocks
    never scored are never multiplied by q or v; the kept set is minimal
    among the scored keys with the unscored bound counted as dropped (its
    excess is stated in ``attention._prefill``). ``keys_scored`` counts the
    q.k products.
  - ``Certified(eps, 'mc')`` and ``bound='lowrank'`` are refused by name
    (no PRNG key here; use ``certified_search`` or ``decode_attention``).

  Args:
    query: ``[batch, q_len, num_heads, head_dim]`` real floating, or
      unbatched ``[q_len, num_heads, head_dim]`` (then key and value are
      unbatched too, and so is every result: ``jax.vmap`` maps a batch).
    key: ``[batch, kv_len, num_kv_heads, head_dim]``; num_heads must be a
      multiple of num_kv_heads (GQA).
    value: ``[batch, kv_len, num_kv_heads, head_dim_v]``.
    bias: optional float additive bias broadcastable to ``[batch,
      num_heads, q_len, kv_len]`` (``[num_heads, q_len, kv_len]``
      unbatched); -inf allowed: a key of zero mass.
    mask: optional bool, same broadcasting, True = attend.
    scale: logit scale, default 1/sqrt(head_dim); a finite number >=
      float32's smallest normal (``core.MIN_SCALE``), or a 0-d JAX array
      (e.g. a learned temperature, traced under jit: rows are then invalid
      where it is not finite and >= ``core.MIN_SCALE``).
    is_causal: top-left aligned causal mask (as jax.nn); a Python bool.
    query_seq_lengths: optional int ``[batch]`` (``[1]`` or a scalar
      unbatched): query rows at or past it attend to nothing (zero output,
      invalid certificate row).
    key_value_seq_lengths: optional int ``[batch]``: keys at or past it are
      masked.
    local_window_size: optional ``(left, right)`` ints >= 0, or one int for
      both: query i sees keys i - left .. i + right only (as jax.nn).
    implementation: None or 'xla' (this path), a registered implementation
      such as 'pallas' or 'sharded' (under ``jax.set_mesh``), or a
      sequence of them tried in order, e.g. ``('pallas', 'xla')``: one
      that refuses the call (a policy field, argument, mask or platform it
      does not support) falls through to the next (``attention.registry``).
    return_residual: also return the log-sum-exp residual (below).
    policy: a selection policy (``Dense``, ``FixedK``, ``Ratio``,
      ``PowerLaw``, ``Certified``); fields a backend cannot honour are
      refused by name (``UnsupportedPolicyError``).
    values_bound: whether the certificate carries output_error_bound.

  Returns:
    ``(output, certificate)``, or ``(output, lse, certificate)`` with
    ``return_residual``: output ``[batch, q_len, num_heads, head_dim_v]`` in
    query's dtype (zeros on an invalid row); ``lse`` ``[batch, q_len,
    num_heads]`` (the shape jax.nn returns), the log-sum-exp of the scaled
    logits (bias included) of the KEPT keys, the logits the output was
    computed from, in float32 (float64 under x64) without gradient; on a
    row that keeps no key it is the most negative finite float (jax.nn's is
    a large negative number there too), never -inf. The Certificate has
    arrays ``[batch, q_len, num_heads]`` (valid = False on a row with no
    real key of positive mass, a NaN or +inf logit, or a non-finite value
    among its real keys). Unbatched inputs drop the batch axis of every
    result. q_len = 0 gives empty arrays; kv_len = 0 gives zeros and
    invalid rows (``checks.empty_result``).

  Raises:
    TypeError: a policy that is not a policy, non-floating or complex
      inputs, a mask that is not boolean, a non-bool ``is_causal``, a scale
      that is not a real number, non-integer sequence lengths or window.
    ValueError: bad shapes, mismatched heads, a scale not finite or below
      float32's smallest normal, a negative window, an unknown
      implementation.
    UnsupportedPolicyError: a policy field the implementation cannot honour
      (every implementation of a sequence refusing: one error naming each
      refusal).
    NotImplementedError: an argument the chosen implementation cannot
      honour (named), or 'pallas' when it is not registered.

  Example:
    >>> import jax, jaxtopk
    >>> x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    >>> out, cert = jaxtopk.topk_attention(x, x, x, policy=jaxtopk.FixedK(3))
    >>> out.shape, cert.k_kept.shape
    ((1, 5, 2, 8), (1, 5, 2))
    >>> out, lse, cert = jaxtopk.topk_attention(
    ...     x[0], x[0], x[0], is_causal=True, local_window_size=(2, 0),
    ...     return_residual=True, policy=jaxtopk.Dense())
    >>> out.shape, lse.shape, cert.k_kept[:, 0].tolist()
    ((5, 2, 8), (5, 2), [1, 2, 3, 3, 3])
  """
  batched = _batched(query, key, value)
  if not batched:
    query, key, value = (jnp.expand_dims(x, 0) for x in (query, key, value))
  args = _checked(query, key, value, policy, mask, bias, is_causal, scale)
  query, key, value, dims, mask, bias, is_causal, scale = args
  lens = _checked_lengths(
    query_seq_lengths, key_value_seq_lengths, dims, not batched
  )
  window = checks.check_window(local_window_size)
  for name, flag in (
    ("values_bound", values_bound),
    ("return_residual", return_residual),
  ):
    if not isinstance(flag, bool):
      raise TypeError(f"{name}={flag!r} must be a bool")
  given = registry.prefill_arguments(
    bias=bias,
    mask=mask,
    is_causal=is_causal,
    query_seq_lengths=lens[0],
    key_value_seq_lengths=lens[1],
    local_window_size=window,
    return_residual=return_residual,
    scale=scale,
  )

  def call(op):
    if dims.empty:
      out, cert = checks.empty_result(
        dims, query.dtype, values_bound=values_bound
      )
      dt = core.compute_dtype(query.dtype)
      return out, cert, jnp.full(cert.shape, jnp.finfo(dt).min, dt)  # log 0
    return op.fn(
      query,
      key,
      value,
      policy=policy,
      mask=mask,
      bias=bias,
      is_causal=is_causal,
      scale=scale,
      query_seq_lengths=lens[0],
      key_value_seq_lengths=lens[1],
      local_window_size=window,
      values_bound=values_bound,
      return_residual=return_residual,
    )

  out, cert, lse = registry.dispatch(
    "prefill",
    implementation,
    call,
    policy=policy,
    given=given,
    mask_shape=None if mask is None else jnp.shape(mask),
  )
  if not batched:
    out = out[0]
    cert = jax.tree.map(lambda x: x[0], cert)
  if not return_residual:
    return out, cert
  lse = jax.lax.stop_gradient(lse)
  return out, lse if batched else lse[0], cert
