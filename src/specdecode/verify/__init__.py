"""Verifiers: decide which drafted tokens the target keeps — exact (greedy matching, rejection sampling, Gumbel-max
coupling) or relaxed and lossy (fly, typical; ``registry.py`` says which is which)."""
