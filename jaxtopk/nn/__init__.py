"""jaxtopk.nn."""
