"""Every kernel lowers for TPU (Mosaic) and GPU (Triton) via jax.export on CPU.

This checks the Pallas -> Mosaic / Triton lowering rules and the block-shape
rules ((8, 128) tiling on TPU, powers of 2 on Triton) without hardware. It
does not run the backend compilers (libtpu / ptxas), so a kernel that lowers
here can still fail to compile on a device.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
from absl.testing import absltest
from absl.testing import parameterized

from jaxtopk import kernels

S = jax.ShapeDtypeStruct
# Pallas Triton calls are custom calls without a stability guarantee.
_DISABLED = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
_PLATFORMS = [("tpu", "tpu"), ("cuda", "gpu")]
B, H, HKV, NQ, NK, D = 1, 4, 2, 256, 512, 128


def _target(platform):
  """Where the export runs on no GPU, the GPU it lowers for: jax >= 0.11's
  Triton lowering reads the device kind (here an H100) from the abstract
  mesh in context."""
  if platform != "cuda" or jax.default_backend() == "gpu":
    return contextlib.nullcontext()
  dev = jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100", num_cores=None, platform="gpu"
  )
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=dev)
  return jax.sharding.use_abstract_mesh(mesh)


def _export(fn, platform, *avals):
  with _target(platform):
    exp = jax.export.export(
      jax.jit(fn), platforms=[platform], disabled_checks=_DISABLED
    )(*avals)
  return exp.mlir_module()


class LoweringTest(parameterized.TestCase):
  @parameterized.product(platform=_PLATFORMS, dtype=[jnp.float32, jnp.bfloat16])
  def test_block_stats(self, platform, dtype):
    plat, backend = platform
    fn = functools.partial(
      kernels.block_stats,
      is_causal=True,
      backend=backend,
      block_sizes=kernels.stats.BlockSizes(128, 128),
    )
    text = _export(
      lambda q, k, m: fn(q, k, mask=m),
      plat,
      S((B, H, NQ, D), dtype),
      S((B, HKV, NK, D), dtype),
      S((B, NK), bool),
    )
    self.assertIn("jaxtopk_block_stats", text)

  @parameterized.product(platform=_PLATFORMS, dtype=[jnp.float32, jnp.bfloat16])
  def test_sparse_flash(self, platform, dtype):
    plat, backend = platform
    fn = functools.partial(
      kernels.sparse_flash_attention,
      is_causal=True,
      backend=backend,
      block_sizes=kernels.sparse_flash.BlockSizes(128, 128),
    )
    text = _export(
      lambda q, k, v, i, c, m: fn(q, k, v, i, c, mask=m),
      plat,
      S((B, H, NQ, D), dtype),
      S((B, HKV, NK, D), dtype),
      S((B, HKV, NK, D), dtype),
      S((B, H, NQ // 128, 4), jnp.int32),
      S((B, H, NQ // 128), jnp.int32),
      S((B, NK), bool),
    )
    self.assertIn("jaxtopk_sparse_flash", text)

  @parameterized.product(platform=_PLATFORMS, dtype=[jnp.float32, jnp.bfloat16])
  def test_certified_decode(self, platform, dtype):
    plat, backend = platform
    fn = functools.partial(
      kernels.certified_decode,
      eps=0.01,
      backend=backend,
      block_sizes=kernels.decode.BlockSizes(128, 4),
    )
    text = _export(
      lambda q, k, v, m: fn(q, k, v, mask=m),
      plat,
      S((B, H, D), dtype),
      S((B, HKV, 4 * NK, D), dtype),
      S((B, HKV, 4 * NK, D), dtype),
      S((B, 4 * NK), bool),
    )
    self.assertIn("jaxtopk_certified_decode", text)

  @parameterized.parameters(*_PLATFORMS)
  def test_certified_prefill_and_gradient(self, plat, backend):
    # The whole prefill (stats -> XLA selection -> sparse flash ->
    # certificate) and the custom_vjp backward (XLA) lower for the platform.
    fn = functools.partial(
      kernels.certified_sparse_attention,
      eps=0.01,
      is_causal=True,
      backend=backend,
      block_sizes=kernels.sparse_flash.BlockSizes(128, 128),
    )

    def loss(q, k, v, m):
      out, cert = fn(q, k, v, mask=m)
      return jnp.sum(out.astype(jnp.float32)), cert.tv_bound

    avals = (
      S((B, H, NQ, D), jnp.bfloat16),
      S((B, HKV, NK, D), jnp.bfloat16),
      S((B, HKV, NK, D), jnp.bfloat16),
      S((B, NK), bool),
    )
    text = _export(loss, plat, *avals)
    self.assertIn("jaxtopk_block_stats", text)
    self.assertIn("jaxtopk_sparse_flash", text)
    # The backward differentiates the XLA reference over the kept blocks
    # (no Pallas backward kernel): only the stats kernel, which chooses the
    # blocks, remains a Pallas call in the gradient.
    grad = jax.grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2))
    gtext = _export(grad, plat, *avals)
    self.assertTrue("jaxtopk_block_stats" in gtext)

  @parameterized.parameters(*_PLATFORMS)
  def test_ragged_lengths(self, plat, backend):
    # q_len 200 and kv_len 300 are not multiples of the 128 tiles (nor
    # powers of 2): the wrappers pad, so both pipelines still lower.
    nq, nk, dt = 200, 300, jnp.bfloat16
    pre = functools.partial(
      kernels.certified_sparse_attention,
      eps=0.01,
      is_causal=True,
      backend=backend,
      block_sizes=kernels.sparse_flash.BlockSizes(128, 128),
    )
    dec = functools.partial(
      kernels.certified_decode,
      eps=0.01,
      backend=backend,
      block_sizes=kernels.decode.BlockSizes(128, 2),
    )
    kv = (S((B, HKV, nk, D), dt), S((B, HKV, nk, D), dt), S((B, nk), bool))
    text = _export(
      lambda q, k, v, m: pre(q, k, v, mask=m), plat, S((B, H, nq, D), dt), *kv
    )
    self.assertTrue("jaxtopk_sparse_flash" in text)
    text = _export(
      lambda q, k, v, m: dec(q, k, v, mask=m), plat, S((B, H, D), dt), *kv
    )
    self.assertTrue("jaxtopk_certified_decode" in text)

  @parameterized.product(
    dims=[(8, 5), (8, 7), (8, 3), (3, 2)],
    dtype=[jnp.float32, jnp.bfloat16],
  )
  def test_odd_head_dims_lower_for_triton(self, dims, dtype):
    # The head / value dims of the compiled kernel tests (not powers of 2,
    # d = 8 below Triton's 16-wide bf16 dot): the GPU wrappers pad them with
    # zeros to a power of 2 >= 16 inside, so every kernel still lowers.
    d, dv = dims
    nq, nk, bq, bk = 37, 301, 16, 32
    pre = functools.partial(
      kernels.certified_sparse_attention,
      eps=0.05,
      is_causal=True,
      backend="gpu",
      block_sizes=kernels.sparse_flash.BlockSizes(bq, bk),
    )
    dec = functools.partial(
      kernels.certified_decode,
      eps=0.05,
      backend="gpu",
      block_sizes=kernels.decode.BlockSizes(16, 3),
    )
    kv = (S((2, HKV, nk, d), dtype), S((2, HKV, nk, dv), dtype))
    m = S((2, nk), bool)
    text = _export(
      lambda q, k, v, m: pre(q, k, v, mask=m),
      "cuda",
      S((2, H, nq, d), dtype),
      *kv,
      m,
    )
    self.assertIn("jaxtopk_block_stats", text)
    self.assertIn("jaxtopk_sparse_flash", text)
    text = _export(
      lambda q, k, v, m: dec(q, k, v, mask=m),
      "cuda",
      S((2, H, d), dtype),
      *kv,
      m,
    )
    self.assertIn("jaxtopk_certified_decode", text)

  def test_bad_tiling_is_caught(self):
    # block_q = 24 is not a power of 2, which Triton requires.
    fn = functools.partial(
      kernels.block_stats,
      backend="gpu",
      block_sizes=kernels.stats.BlockSizes(24, 128),
    )
    with self.assertRaisesRegex(ValueError, "block_q=24 must be a power of 2"):
      _export(
        fn,
        "cuda",
        S((B, H, 48, D), jnp.float32),
        S((B, HKV, NK, D), jnp.float32),
      )
    # Refused by name before lowering, on the other GPU kernels too.
    q, kv = S((B, H, 64, D), jnp.float32), S((B, HKV, NK, D), jnp.float32)
    pre = functools.partial(
      kernels.certified_sparse_attention,
      eps=0.01,
      backend="gpu",
      block_sizes=kernels.sparse_flash.BlockSizes(16, 48),
    )
    with self.assertRaisesRegex(ValueError, "block_k=48 must be a power of 2"):
      _export(pre, "cuda", q, kv, kv)
    dec = functools.partial(
      kernels.certified_decode,
      eps=0.01,
      backend="gpu",
      block_sizes=kernels.decode.BlockSizes(24, 2),
    )
    with self.assertRaisesRegex(ValueError, "block_k=24 must be a power of 2"):
      _export(dec, "cuda", S((B, H, D), jnp.float32), kv, kv)


if __name__ == "__main__":
  absltest.main()
