"""Verifiers: decide which drafted tokens the target keeps (greedy matching, rejection sampling)."""
