"""The XLA decode traced afresh inside one test, the worker's programs kept.

``_decode._xla_decode`` picks its routes from module constants when it is
traced (``CHUNK_MIN_STEPS``, ``AUTO_CODES_PLATFORMS``,
``_cache.PAGE_SCAN_MIN_BYTES``, ...). A test that patches one runs the
decode inside ``fresh_decode()``: a jit of its own, with its own cache, so
the test's calls trace with the patch and the programs the worker compiled
before stay cached for the tests after it (clearing the shared jit's cache
recompiled them).
"""

import contextlib
from unittest import mock

import jax

from jaxtopk.attention import _decode


@contextlib.contextmanager
def fresh_decode():
  """``_decode._xla_decode`` replaced by a fresh jit of the same function."""
  fresh = jax.jit(
    _decode._xla_decode.__wrapped__, static_argnames=_decode.XLA_DECODE_STATIC
  )
  with mock.patch.object(_decode, "_xla_decode", fresh):
    yield
