"""Verifiers: decide which drafted tokens the target keeps — exact (greedy matching, rejection sampling, Gumbel-max
coupling) or relaxed and lossy (fly, typical, judge).  Each is one module that registers itself
(:mod:`specdecode.verify.registry`), which says which is which."""
