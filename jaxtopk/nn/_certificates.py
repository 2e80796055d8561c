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

from jaxtopk.selection import Certificate


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
    called are absent.

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
