"""Gaussian score model: asymptotic tail mass and k_eps rule (THEORY 5).

Logits s_i iid N(mu, sigma^2) (mu cancels). Keeping the fraction rho of
largest logits, the threshold is z = Phi_c^{-1}(rho) in standard units and,
by the law of large numbers (5.1, 5.2),

  tau(rho) -> Phi(Phi_c^{-1}(rho) - sigma),
  k_eps / n -> Phi_c(sigma + Phi^{-1}(eps))          (5.3, the rule).

The limit needs sigma well below sqrt(2 ln n) (5.4): beyond it the few
largest logits dominate Z, and the finite-n expectation of k_eps / n falls
below the rule. ``gaussian_k_eps_finite_n`` gives that expectation by Monte
Carlo with a confidence interval, memory-safe for large n.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.stats import norm

from jaxtopk.theory import _rows

# Largest number of logits drawn at once by the Monte Carlo (floats).
_MC_CHUNK_ELEMS = 1 << 21


class KEpsEstimate(NamedTuple):
  """Monte Carlo estimate of E[k_eps / n] with a confidence interval.

  Attributes:
    mean: sample mean of k_eps / n over the rows drawn.
    std_error: standard error of the mean (sample std / sqrt(num_samples)).
    ci_low: lower end of the normal-approximation confidence interval.
    ci_high: upper end of it.
  """

  mean: jax.Array
  std_error: jax.Array
  ci_low: jax.Array
  ci_high: jax.Array


def gaussian_tail_mass(rho, sigma) -> jax.Array:
  """Asymptotic tail mass tau(rho) = Phi(Phi_c^{-1}(rho) - sigma) (5.2).

  Args:
    rho: kept fraction k/n in (0, 1] (any shape; broadcasts with sigma).
    sigma: logit standard deviation, >= 0.

  Returns:
    tau in float32 (float64 under x64 with float64 inputs); 0 at rho = 1.

  Example:
    >>> round(float(gaussian_tail_mass(0.5, 0.0)), 4)  # uniform logits
    0.5
  """
  rho = jnp.asarray(rho)
  dt = _rows.compute_dtype(jnp.result_type(rho, jnp.asarray(sigma)))
  rho = rho.astype(dt)
  z = -norm.ppf(rho)  # Phi_c^{-1}(rho), accurate for small rho
  return norm.cdf(z - jnp.asarray(sigma, dt))


def gaussian_k_eps_rule(sigma, eps) -> jax.Array:
  """The [TV] rule k_eps / n ~ Phi_c(sigma + Phi^{-1}(eps)) (THEORY 5.3).

  The kept fraction at which ``gaussian_tail_mass`` equals eps. Valid for
  sigma well below sqrt(2 ln n) (see ``gaussian_sigma_limit``).

  Args:
    sigma: logit standard deviation, >= 0 (any shape; broadcasts with eps).
    eps: tail budget in (0, 1).

  Returns:
    Predicted fraction k_eps / n in (0, 1).

  Raises:
    ValueError: if a concrete ``eps`` is outside (0, 1).

  Example:
    >>> round(float(gaussian_k_eps_rule(2.0, 0.05)), 3)
    0.361
  """
  _rows.check_eps(eps)
  sigma = jnp.asarray(sigma)
  dt = _rows.compute_dtype(jnp.result_type(sigma, jnp.asarray(eps)))
  return norm.sf(sigma.astype(dt) + norm.ppf(jnp.asarray(eps, dt)))


def gaussian_sigma_limit(n) -> jax.Array:
  """sqrt(2 ln n): the rule needs sigma well below this (THEORY 5.4)."""
  return jnp.sqrt(2.0 * jnp.log(jnp.asarray(n, jnp.float32)))


def _k_eps_sorted(z, sigma, eps):
  """k_eps of the row sigma * z for a decreasingly sorted standard row z."""
  w = jnp.exp(sigma * (z - z[0]))  # [n], in (0, 1]
  # Suffix sums (smallest terms first): tail mass after each prefix.
  suffix = jnp.cumsum(w[::-1])[::-1]  # [n]
  log_tails = jnp.log(suffix) - jnp.log(suffix[0])
  return jnp.sum(log_tails > jnp.log(eps), dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("n", "num_samples", "dtype"))
def _k_eps_fractions(key, sigma, eps, *, n, num_samples, dtype):
  """[num_samples, m] fractions k_eps / n for m (sigma, eps) pairs."""
  keys = jax.random.split(key, num_samples)

  def one(k):
    z = -jnp.sort(-jax.random.normal(k, (n,), dtype))  # [n] decreasing
    per_pair = jax.vmap(_k_eps_sorted, in_axes=(None, 0, 0))
    return per_pair(z, sigma, eps) / n  # [m]

  batch = max(1, min(num_samples, _MC_CHUNK_ELEMS // n))
  return jax.lax.map(one, keys, batch_size=batch)  # [num_samples, m]


def gaussian_k_eps_finite_n(
  key, n: int, sigma, eps, *, num_samples: int = 64, confidence: float = 0.95
) -> KEpsEstimate:
  """Monte Carlo E[k_eps / n] for n iid N(0, sigma^2) logits (THEORY 5.4).

  Draws ``num_samples`` standard normal rows z, computes the exact k_eps of
  each row sigma * z (one sort per row, shared by every (sigma, eps) pair:
  common random numbers), and returns the mean fraction with a
  normal-approximation confidence interval. Rows are drawn in chunks of at
  most 2^21 logits, so memory stays bounded for n up to 131072 and beyond.

  Args:
    key: a ``jax.random`` key.
    n: static number of keys per row, >= 1.
    sigma: logit standard deviation(s), >= 0; any shape broadcastable with
      ``eps`` (may be traced).
    eps: tail budget(s) in (0, 1).
    num_samples: static number of rows, >= 2.
    confidence: level of the interval in (0, 1).

  Returns:
    KEpsEstimate of float32 arrays (float64 under x64) of the broadcast
    shape of ``sigma`` and ``eps``.

  Raises:
    ValueError: for n < 1, num_samples < 2, a negative sigma, or eps or
      confidence outside (0, 1).

  Example:
    >>> est = gaussian_k_eps_finite_n(jax.random.key(0), 512, 1.0, 0.1)
    >>> bool(est.ci_low <= est.mean <= est.ci_high)
    True
  """
  if int(n) != n or n < 1:
    raise ValueError(f"{n=} must be an integer >= 1")
  if int(num_samples) != num_samples or num_samples < 2:
    raise ValueError(f"{num_samples=} must be an integer >= 2")
  if not 0 < confidence < 1:
    raise ValueError(f"{confidence=} must be in (0, 1)")
  _rows.check_eps(eps)
  sg = _rows.concrete(sigma)
  if sg is not None and np.any(sg < 0):
    raise ValueError(f"{sigma=} must be >= 0")
  dt = _rows.compute_dtype(jnp.result_type(float))
  sigma, eps = jnp.broadcast_arrays(
    jnp.asarray(sigma, dt), jnp.asarray(eps, dt)
  )
  fr = _k_eps_fractions(
    key,
    sigma.reshape(-1),
    eps.reshape(-1),
    n=int(n),
    num_samples=int(num_samples),
    dtype=dt,
  )  # [num_samples, m]
  mean = jnp.mean(fr, axis=0).reshape(sigma.shape)
  se = (jnp.std(fr, axis=0, ddof=1) / np.sqrt(num_samples)).reshape(sigma.shape)
  z = norm.ppf(jnp.asarray(0.5 + confidence / 2, dt))
  return KEpsEstimate(
    mean=mean, std_error=se, ci_low=mean - z * se, ci_high=mean + z * se
  )
