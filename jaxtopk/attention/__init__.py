"""jaxtopk.attention."""
