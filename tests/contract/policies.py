"""Every policy the contract test crosses with every attention variant.

One line per policy; together they use every field of every policy
(``Policy.features``): the four fixed-count policies, and ``Certified`` with
each search strategy (the default Auto, which every path honours at least
as the exact search; Delta-Search with the box, the low-rank and the
key-code bound; MC-Search), each with its own fields set, ``max_topk``
and ``dense_above``. A policy
joins by adding one line. Block sizes are 4 so that block-granular paths
(Pallas, Delta-/MC-Search) really keep or drop blocks of the 7-key rows.
"""

import jaxtopk

BLOCK = 4  # block_size of every Certified policy (and of decode caches)

POLICIES = (
  ("dense", jaxtopk.Dense()),
  ("fixed_k", jaxtopk.FixedK(3)),
  ("ratio", jaxtopk.Ratio(0.4)),
  ("power_law", jaxtopk.PowerLaw(1.2, 0.5)),
  ("cert_exact", jaxtopk.Certified(0.1, jaxtopk.Auto(block_size=BLOCK))),
  (
    "cert_exact_cap",
    jaxtopk.Certified(0.02, jaxtopk.Auto(block_size=BLOCK), max_topk=4),
  ),
  ("cert_delta", jaxtopk.Certified(0.1, jaxtopk.DeltaSearch(block_size=BLOCK))),
  (
    "cert_dense_above",
    jaxtopk.Certified(0.1, jaxtopk.Auto(block_size=BLOCK), dense_above=0.5),
  ),
  (
    "cert_delta_cap",
    jaxtopk.Certified(0.05, jaxtopk.DeltaSearch(block_size=BLOCK), max_topk=4),
  ),
  (
    "cert_lowrank",
    jaxtopk.Certified(
      0.1, jaxtopk.DeltaSearch(block_size=BLOCK, bound=jaxtopk.LowRank(2))
    ),
  ),
  (
    "cert_codes",
    jaxtopk.Certified(
      0.1, jaxtopk.DeltaSearch(block_size=BLOCK, bound=jaxtopk.Codes())
    ),
  ),
  (
    "cert_mc",
    jaxtopk.Certified(
      0.1, jaxtopk.MCSearch(block_size=BLOCK, failure_prob=0.05, num_samples=2)
    ),
  ),
)

BY_NAME = dict(POLICIES)


def features(policy) -> frozenset[str]:
  """The capability names ``policy`` asks for."""
  return frozenset(f for _, _, f in policy.features())


def field_names(policy) -> list[str]:
  """Names an error refusing ``policy`` may use (field or policy repr)."""
  names = []
  for field, value, _ in policy.features():
    names.append(field if "." in field else repr(value))
  return names
