"""The sub-commands of ``specdecode bench``, one module each (see :mod:`specdecode.bench.benchmark`)."""
