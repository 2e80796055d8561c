"""jaxtopk.parallel."""
