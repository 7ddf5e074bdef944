"""The constants ``auto`` decides with (:mod:`specdecode.draft_length.cost_model`,
:mod:`specdecode.draft_length.sequence`), each with why it is what it is."""

#: How many steps of evidence a new sequence's acceptance estimate inherits from earlier requests: enough to start
#: from what they taught, little enough that a chat answer and a copied edit soon part ways.
SEQUENCE_PRIOR_WEIGHT = 4.0

#: A sequence stops drafting (and only probes) once its drafting steps have measurably yielded less than
#: this share of the tokens per second that plain steps would have, over at least ``MIN_GAIN_EVIDENCE``
#: steps' worth of (decayed) evidence.
LOSING_GAIN = 0.97
MIN_GAIN_EVIDENCE = 6.0
#: A probe that paid replaces that evidence with itself, worth this many steps.
PROBE_GAIN_WEIGHT = 2.0
#: A new sequence starts at the probe interval its predecessors' probes left, at most this many ``probe_every``:
#: probes that keep losing cost a request one probe, not three; other text is still tried within 32 steps.  A
#: policy whose prior acceptance (a self-drafter's, measured) makes no depth pay starts there too.
INHERITED_PROBE_BACKOFF = 4
#: A depth is drafted only when expected to yield this many times plain decoding's tokens/s: the inputs are
#: estimates, and drafting costs what they omit, so a draft expected to break even loses
#: (docs/results/quick-every-auto-r5/, docs/results/quick-self-margin-r5/).
DRAFT_MARGIN = 1.03
#: What one sequence's drafting may lose against plain decoding, net of what it gained: this share of the
#: sequence's time so far (its prefill included) plus ``LOSS_ALLOWANCE_STEPS`` plain steps.  Past it the
#: sequence drafts nothing, probes included, until its time has grown enough to pay for more trying.  This
#: caps what a drafter that finds nothing costs a cold request — its first guesses and its probes, each of which
#: can cost most of a target forward for a self-drafter (docs/results/w4a8-epyc-budget1-r8/).  Drafting that pays
#: banks its gains: never limited.
LOSS_BUDGET = 0.01
LOSS_ALLOWANCE_STEPS = 0.5
#: A drafter that reads the context (its first forward also reads the prompt: ``StepObservation.setup_s``)
#: drafts at most ``UNTIMED_DEPTH`` deep until its cost has been timed over this many drafting steps: a prompt's
#: forward tells little of a token's cost, and a deep first draft of a dear draft model, all rejected, costs a
#: short answer much of its time (docs/results/untimed-drafter-reruns/).  Depth 2 times a one-token forward at the
#: price of one.
UNTIMED_STEPS = 2
UNTIMED_DEPTH = 2
#: The most tokens a sequence is counted on to still generate (at most what its ``max_new_tokens`` leaves)
#: when ``auto`` weighs a drafter's reading of the prompt against what its drafts would save: a long chat
#: answer.  Beyond it, an answer may well have ended at EOS.
ANSWER_HORIZON = 256
