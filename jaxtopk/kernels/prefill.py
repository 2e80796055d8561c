"""The certified sparse prefill: block statistics, block selection and the
sparse flash pass, with the certificate of the kept blocks.

``certified_sparse_attention`` (and its pure-jnp reference) composes
``jaxtopk.kernels.stats``, ``jaxtopk.kernels.select`` and
``jaxtopk.kernels.sparse_flash``; ``prefill_certificate`` certifies a block
selection.
"""

from jaxtopk.kernels._prefill import certified_sparse_attention
from jaxtopk.kernels._prefill import certified_sparse_attention_reference
from jaxtopk.kernels._prefill import prefill_certificate

__all__ = [
  "certified_sparse_attention",
  "certified_sparse_attention_reference",
  "prefill_certificate",
]
