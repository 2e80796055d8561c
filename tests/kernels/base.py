"""Shared base for kernel tests: interpret mode on CPU, small random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from tests import rand


class KernelTestCase(parameterized.TestCase):
  """Kernel tests run the Pallas kernels in interpret mode (no accelerator).

  A compiled subclass (``INTERPRET = False``) is for machines with a TPU or
  GPU; none was available to this project's CI.
  """

  INTERPRET = True

  def setUp(self):
    super().setUp()
    if not self.INTERPRET and jax.default_backend() == "cpu":
      self.skipTest("compiled kernels need a TPU or GPU")

  def grid(self, backend: str) -> str:
    """``backend`` (grid style) to test; compiled runs skip the other one."""
    here = "gpu" if jax.default_backend() == "gpu" else "tpu"
    if not self.INTERPRET and backend != here:
      self.skipTest(f"the {backend} grid style compiles only on a {backend}")
    return backend

  def inputs(self, b, h, hkv, nq, nk, d, dv, dtype, seed=0, spread=2.0):
    """q [b,h,nq,d], k [b,hkv,nk,d], v [b,hkv,nk,dv], padding mask [b,nk]."""
    rng = rand.generator(seed)
    q = spread * rng.standard_normal((b, h, nq, d))
    k = rng.standard_normal((b, hkv, nk, d))
    v = rng.standard_normal((b, hkv, nk, dv))
    mask = rng.random((b, nk)) > 0.25
    mask[:, 0] = True
    q, k, v = (jax.device_put(x.astype(dtype)) for x in (q, k, v))
    return q, k, v, jax.device_put(mask)


def planted(b, h, hkv, nq, nk, d, dv, dtype, *, block_k, block_q, seed=0):
  """Concentrated attention: keys cluster by block, query tiles aim at one.

  Keys of block j are centre_j + 0.1 noise; every query of tile t is
  3 * centre of block (t * 5 + head) % n_blocks plus noise, so most of a row's
  mass sits in one block and block-sparse attention really drops blocks.

  Returns:
    q [b, h, nq, d], k [b, hkv, nk, d], v [b, hkv, nk, dv], mask [b, nk].
  """
  rng = rand.generator(seed)
  nb = -(-nk // block_k)
  centre = rng.standard_normal((b, hkv, nb, d))
  k = np.repeat(centre, block_k, axis=2)[:, :, :nk]
  k = k + 0.1 * rng.standard_normal((b, hkv, nk, d))
  g = h // hkv
  tile = np.arange(nq) // block_q  # [nq]
  target = (tile[None, :] * 5 + np.arange(h)[:, None]) % nb  # [h, nq]
  cq = np.repeat(centre, g, axis=1)  # [b, h, nb, d]
  q = 3.0 * np.take_along_axis(cq, target[None, :, :, None], axis=2)
  q = q + 0.3 * rng.standard_normal((b, h, nq, d))
  v = rng.standard_normal((b, hkv, nk, dv))
  mask = rng.random((b, nk)) > 0.25
  mask[:, 0] = True
  q, k, v = (jax.device_put(x.astype(dtype)) for x in (q, k, v))
  return q, k, v, jax.device_put(mask)


def finite_close(test, got, want, **tol):
  """Asserts equal -inf patterns and close finite values."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
  fin = np.isfinite(want)
  np.testing.assert_allclose(got[fin], want[fin], **tol)
  del test
  return jnp.asarray(got)
