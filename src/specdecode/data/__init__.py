"""Prompt sets, data sets and corpora: what the benchmark measures on and what drafters and heads are fitted to.

Below ``drafters``, ``train`` and ``bench``, which all read it; it reads only ``models`` (to cache and render
text for a model) and ``errors``.
"""
