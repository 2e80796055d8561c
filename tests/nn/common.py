"""Shared test sizes for tests/nn (random inputs: ``tests.rand``)."""

# Every test dimension a different size, so a transposed axis cannot pass.
BATCH, Q_LEN, KV_LEN, FEATURES = 3, 5, 7, 11
