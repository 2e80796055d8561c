"""jaxtopk.kernels."""
