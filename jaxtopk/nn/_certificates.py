"""Reading a model's certificates back, per layer and per head.

A certified layer records its last call's Certificate (THEORY 6.5) on itself;
``topk_attention_fn`` sows it into the calling module when asked
(``sow_weights=True``); Linen models keep sown values in ``'intermediates'``.
``collect_certificates`` finds every Certificate in any of these containers
and names it by where it sits, so a model can report per layer and head what
its last forward pass kept, scored and dropped.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtopk.nn._attention import CertifiedTopKAttention
from jaxtopk.selection import Certificate
from jaxtopk.selection import core


def _key_name(entry: Any) -> str | None:
  """One path entry as a string; None for a Variable's own ``value`` slot."""
  if isinstance(entry, jax.tree_util.DictKey):
    return str(entry.key)
  if isinstance(entry, jax.tree_util.SequenceKey):
    return str(entry.idx)
  if isinstance(entry, jax.tree_util.GetAttrKey):
    return None if entry.name in ("value", "raw_value") else entry.name
  if isinstance(entry, jax.tree_util.FlattenedIndexKey):
    return None  # a Variable's single child
  return str(entry)


def collect_certificates(tree: Any) -> dict[str, Certificate]:
  """Every Certificate in a model or a state, keyed by its path.

  Args:
    tree: an ``nnx.Module`` (its ``CertifiedTopKAttention`` layers'
      ``last_certificate`` and any sown ``'certificate'``), an ``nnx.State``
      (e.g. from ``nnx.capture(model, nnx.Intermediate)``), or a Linen
      variables dict (e.g. the ``mutable=['intermediates']`` output of
      ``apply``).

  Returns:
    ``{path: Certificate}`` in model order; paths join attribute names with
    ``'/'``, e.g. ``'blocks/0/attn/last_certificate'``, and sown tuples add
    the call index, e.g. ``'attn/certificate/0'``. Arrays keep their shape,
    ``[batch..., q_len, num_heads]`` for attention layers. Layers not yet
    called are absent (after ``init_certificates``: present, every row
    invalid).

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxtopk
    >>> from flax import nnx
    >>> model = nnx.Sequential(*[
    ...     jaxtopk.nn.CertifiedTopKAttention(
    ...         num_heads=2, in_features=6, policy=jaxtopk.FixedK(3),
    ...         decode=False, rngs=nnx.Rngs(0)) for _ in range(2)])
    >>> y = model(jnp.ones((1, 5, 6)))
    >>> certs = jaxtopk.nn.collect_certificates(model)
    >>> list(certs)
    ['layers/0/last_certificate', 'layers/1/last_certificate']
    >>> certs['layers/1/last_certificate'].k_kept.shape
    (1, 5, 2)
  """
  if isinstance(tree, nnx.Module):
    tree = nnx.state(tree, nnx.Intermediate)
  found = {}
  leaves, _ = jax.tree_util.tree_flatten_with_path(
    tree, is_leaf=lambda x: isinstance(x, Certificate)
  )
  for path, leaf in leaves:
    if isinstance(leaf, Certificate):
      names = (_key_name(entry) for entry in path)
      found["/".join(n for n in names if n is not None)] = leaf
  return found


def init_certificates(model: nnx.Module, *args: Any, **kwargs: Any) -> None:
  """Gives every ``CertifiedTopKAttention`` in ``model`` its
  ``last_certificate`` for a call ``model(*args, **kwargs)``, before it runs.

  A layer creates ``last_certificate`` on its first call (a fresh layer
  holds exactly nnx.MultiHeadAttention's state), so a jitted training step
  over a fresh model sees a new state on its second call and compiles
  twice (seq 1,024, 4 heads, features 256, Certified(0.05), XLA:CPU:
  12.2 s, then 9.4 s; nnx.MultiHeadAttention 1.5 s). Called once before
  the loop, this compiles nothing: the shapes come from ``nnx.eval_shape``
  (parameters, rng counts and caches are left as they are), and each layer
  the call reaches gets a placeholder of those shapes whose rows are
  invalid (``valid`` False, ``tv_bound`` NaN, ``k_kept`` 0;
  ``core.mark_invalid``) until its next call overwrites it (a certificate
  it held is replaced); layers the call does not reach are left as they
  are.

  Args:
    model: an ``nnx.Module`` holding certified layers (or one such layer).
    *args: the call's arguments: arrays or ``jax.ShapeDtypeStruct``.
    **kwargs: its keyword arguments (e.g. ``is_causal=True``).

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxtopk
    >>> from flax import nnx
    >>> layer = jaxtopk.nn.CertifiedTopKAttention(
    ...     num_heads=2, in_features=6, policy=jaxtopk.Certified(0.05),
    ...     decode=False, rngs=nnx.Rngs(0))
    >>> jaxtopk.nn.init_certificates(layer, jnp.ones((1, 5, 6)))
    >>> cert = layer.last_certificate.get_value()
    >>> cert.tv_bound.shape, bool(cert.valid.any())
    ((1, 5, 2), False)
  """

  def layers(m):
    return [
      (path, layer)
      for path, layer in nnx.iter_modules(m)
      if isinstance(layer, CertifiedTopKAttention)
    ]

  # Arrays and ShapeDtypeStructs go through eval_shape; other leaves (e.g.
  # is_causal=True) stay Python values.
  leaves, tree = jax.tree.flatten((args, kwargs))
  dynamic = [
    isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in leaves
  ]

  def shapes(m, arrays):
    it = iter(arrays)
    full = [next(it) if d else x for d, x in zip(dynamic, leaves, strict=True)]
    a, kw = jax.tree.unflatten(tree, full)
    for _, layer in layers(m):  # so that only the layers the call reaches
      if "last_certificate" in vars(layer):  # hold one afterwards (in this
        del layer.last_certificate  # copy): the class default, None
    m(*a, **kw)
    return {
      path: layer.last_certificate.get_value()
      for path, layer in layers(m)
      if layer.last_certificate is not None
    }

  arrays = [x for d, x in zip(dynamic, leaves, strict=True) if d]
  abstract = nnx.eval_shape(shapes, model, arrays)
  for path, layer in layers(model):
    if path not in abstract:  # not reached by this call: left as it is
      continue
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract[path])
    layer._record(core.mark_invalid(zeros, True), False)


def per_head_report(cert: Certificate) -> dict[str, np.ndarray]:
  """Per-head figures of one layer's Certificate, over its valid rows.

  Args:
    cert: a Certificate with arrays ``[..., num_heads]``.

  Returns:
    float64 numpy arrays ``[num_heads]``: ``tv_bound_max`` (worst certified
    dropped mass, NaN for a head with no valid row), ``k_kept_mean``,
    ``keys_scored_mean`` and ``valid_fraction``.
  """
  valid = np.asarray(cert.valid, bool)
  heads = valid.shape[-1]
  valid = valid.reshape(-1, heads)

  def flat(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64).reshape(
      -1, heads
    )

  count = valid.sum(0)
  with np.errstate(invalid="ignore", divide="ignore"):
    tv = np.where(valid, flat(cert.tv_bound), -np.inf).max(0)
    return {
      "tv_bound_max": np.where(count > 0, tv, np.nan),
      "k_kept_mean": np.where(valid, flat(cert.k_kept), 0).sum(0) / count,
      "keys_scored_mean": (
        np.where(valid, flat(cert.keys_scored), 0).sum(0) / count
      ),
      "valid_fraction": count / valid.shape[0],
    }
