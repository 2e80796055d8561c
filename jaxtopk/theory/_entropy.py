"""Attention entropy H(P) = -sum_i P_i log P_i per row (THEORY 8.4).

[NATIVE] reports lower entropy for Top-k-trained models. Computed as
H = log Z' - sum_i P_i (s_i - ref) with every sum relative to the row's
largest logit (no P log P of underflowed probabilities). In nats.
"""

import jax.numpy as jnp
from jaxtyping import Array
from jaxtyping import ArrayLike
from jaxtyping import Bool
from jaxtyping import Float

from jaxtopk.theory import _rows


def attention_entropy_row(logits, mask):
  s = logits.astype(_rows.compute_dtype(logits.dtype))
  ref, ok = _rows.row_ref(s, mask)
  allm = _rows.log_mass(s, mask, ref)
  d = jnp.where(mask, s - ref, 0.0)  # [n] <= 0
  p = jnp.where(mask, jnp.exp(d - allm.log), 0.0)  # [n] P_i
  h = allm.log - jnp.sum(jnp.where(p > 0, p * d, 0.0))
  return jnp.where(ok, jnp.maximum(h, 0.0), jnp.nan)


def attention_entropy(
  logits: Float[ArrayLike, "*b n"], mask: Bool[ArrayLike, "*b n"] | None = None
) -> Float[Array, "*b"]:
  """Shannon entropy of each softmax row, in nats (THEORY 8.4).

  0 for a one-hot row, log n for a uniform row over n real keys. A -inf
  logit among finite ones is a key of zero mass (0 log 0 = 0).

  Args:
    logits: ``[..., n_keys]`` logits.
    mask: optional ``[..., n_keys]`` bool, False for padded keys.

  Returns:
    ``[...]`` float32 (float64 for float64 input); NaN for a row with no
    distribution (no real key, or a NaN / +inf real logit).

  Example:
    >>> import jax.numpy as jnp
    >>> round(float(attention_entropy(jnp.zeros(4))), 4)  # log 4
    1.3863
  """
  logits = jnp.asarray(logits)
  _rows.check_has_key_axis(logits)
  _rows.check_same_shape(logits, mask=mask)
  valid = _rows.as_mask(logits, mask)
  return _rows.apply_rows(attention_entropy_row, 0, (), logits, valid)
