"""Linen access to CertifiedTopKAttention through ``flax.nnx.bridge``.

``topk_attention_linen(num_heads=..., in_features=..., policy=...)`` returns a
``linen.Module`` wrapping the NNX layer (``nnx.bridge.to_linen``): the same
keyword arguments (``rngs`` comes from Linen's rng streams), parameters under
``params`` with the NNX layer's names (``query``, ``key``, ``value``, ``out``).
The last call's Certificate lands in the Linen collection ``'certificates'``
when that collection is mutable in ``apply``; read it with
``jaxtopk.nn.collect_certificates(state)``.
"""

from flax import linen
from flax import nnx

from jaxtopk.nn._attention import CertifiedTopKAttention


def topk_attention_linen(*, name: str | None = None, **kwargs) -> linen.Module:
  """Linen form of ``CertifiedTopKAttention`` (same keyword arguments).

  Args:
    name: the Linen submodule name (optional).
    **kwargs: keyword arguments of ``CertifiedTopKAttention`` except
      ``rngs``; they must be hashable (policies are).

  Returns:
    A ``flax.nnx.bridge.ToLinen`` module, usable inside any Linen model.

  Example:
    >>> import jax, jax.numpy as jnp, jaxtopk
    >>> layer = jaxtopk.nn.topk_attention_linen(
    ...     num_heads=2, in_features=6, policy=jaxtopk.Dense(), decode=False)
    >>> x = jnp.ones((3, 5, 6))
    >>> variables = layer.init(jax.random.key(0), x)
    >>> y, state = layer.apply(variables, x, mutable=["certificates"])
    >>> y.shape
    (3, 5, 6)
  """
  return nnx.bridge.to_linen(CertifiedTopKAttention, name=name, **kwargs)
