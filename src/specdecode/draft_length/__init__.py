"""How far to draft each step.

A fixed K is wrong whenever costs or acceptance vary: on a CPU a verification forward over 8 tokens
costs 2-3x one token, so drafting deep only pays while the drafter is being accepted.  A request asks for a
draft length (:data:`specdecode.config.DraftLength`: ``Fixed(k)``, ``Auto``, ``Heuristic``), which
:func:`~specdecode.draft_length.factory.make_policy` turns into a policy (:mod:`~specdecode.draft_length.base`):

* ``FixedLength(k)`` — always k (the classic setting);
* ``HeuristicLength`` — transformers' assisted-generation schedule: +2 after a fully accepted draft,
  -1 otherwise;
* ``auto`` — a :class:`~specdecode.draft_length.cost_model.CostModel` shared by the requests of one drafter,
  each sequence deciding with its own :class:`~specdecode.draft_length.sequence.CostModelLength`: the depth
  that maximises expected tokens per second, from the verification forward's cost as a function of its width
  (measured once per model), online estimates of per-position acceptance and of the drafter's own cost;
  drafters that report per-token confidences get a SpecDec++-style stop threshold derived from the same costs;
  and a sequence whose drafting has lost more than a small budget against plain decoding stops trying.
"""
