"""Training of drafter weights on the target's own outputs (``specdecode train ...``)."""
