"""Model backends, loading, and the offline registry of bundled models."""
