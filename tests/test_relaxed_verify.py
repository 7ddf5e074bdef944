"""Relaxed (lossy) verification: FLy and typical acceptance on hand-built logits, then through the engine, the
CLI and the server.  Each relaxed verifier must keep a mismatch the exact one rejects where the target is
unsure, and reject what it must (a peaked row, an implausible token, a window the target breaks)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

from helpers import assert_one_line_error, serving
from specdecode.cli import main
from specdecode.config import GenerationConfig
from specdecode.drafters.base import Drafter, StatelessSession
from specdecode.engine import TargetVerifier
from specdecode.errors import SpecDecodeError
from specdecode.generator import SpeculativeGenerator
from specdecode.sampling import argmax_last, coupled_sample
from specdecode.sampling_params import SamplingParams
from specdecode.server.app import ServerConfig, Service, create_app
from specdecode.types import Draft, Verdict
from specdecode.verify.base import TargetRows
from specdecode.verify.coupled import verify_coupled
from specdecode.verify.fly import FlyOptions, verify_fly
from specdecode.verify.greedy import verify_greedy
from specdecode.verify.registry import (
    VerifierChoice,
    check_verifier,
    format_verifiers,
    is_lossless,
    parse_verifier,
    verifiers,
)
from specdecode.verify.typical import TypicalOptions, verify_typical

V = 50
GREEDY = SamplingParams()
PARAMS = FlyOptions(entropy=0.1, top_k=5, min_prob=0.05, window=2)
TYPICAL = TypicalOptions()


def flat(top: int, second: int) -> torch.Tensor:
    """A row where the target is unsure: ``top`` barely ahead of ``second``, the rest not far behind."""
    row = torch.zeros(V)
    row[top], row[second] = 2.0, 1.8
    return row


def peaked(top: int) -> torch.Tensor:
    """A row where the target is sure of ``top``."""
    row = torch.zeros(V)
    row[top] = 20.0
    return row


def rows(*logits: torch.Tensor, sampling: SamplingParams = GREEDY, **kw) -> TargetRows:
    return TargetRows(torch.stack(logits), sampling, **kw)


# -- FLy ------------------------------------------------------------------------------------------------


def test_fly_keeps_a_plausible_mismatch_at_a_flat_row_once_the_window_confirms_it():
    logits = (flat(3, 4), peaked(7), peaked(8), peaked(9))
    draft = Draft([4, 7, 8])
    assert verify_greedy(argmax_last(torch.stack(logits)), draft) == Verdict((), 3)  # exact rejects the 4
    assert verify_fly(rows(*logits), draft, PARAMS) == Verdict((0, 1, 2), 9)


def test_fly_rejects_at_a_peaked_row_and_an_implausible_token():
    draft = Draft([4, 7, 8])
    assert verify_fly(rows(peaked(3), peaked(7), peaked(8), peaked(9)), draft, PARAMS) == Verdict((), 3)
    outsider = flat(3, 4)
    outsider[4] = -5.0  # far below the top-k and the probability floor
    assert verify_fly(rows(outsider, peaked(7), peaked(8), peaked(9)), draft, PARAMS) == Verdict((), 3)
    strict = FlyOptions(entropy=0.1, top_k=1, window=2)  # only the argmax is "plausible": exact again
    assert verify_fly(rows(flat(3, 4), peaked(7), peaked(8), peaked(9)), draft, strict) == Verdict((), 3)


def test_fly_rolls_back_when_the_target_disagrees_inside_the_window():
    # After the provisional 4 the target wants 7 (kept) and then 5, not the drafted 8: the 4 was an error.
    draft = Draft([4, 7, 8])
    assert verify_fly(rows(flat(3, 4), peaked(7), peaked(5), peaked(9)), draft, PARAMS) == Verdict((), 3)
    # A draft that ends inside the window cannot vouch for the mismatch either.
    assert verify_fly(rows(flat(3, 4), peaked(7), peaked(9)), Draft([4, 7]), PARAMS) == Verdict((), 3)
    # Exact matches before the mismatch stay; the rollback emits the target's own token at the mismatch.
    logits = (peaked(1), flat(3, 4), peaked(7), peaked(5), peaked(9))
    assert verify_fly(rows(*logits), Draft([1, 4, 7, 8]), PARAMS) == Verdict((0,), 3)


def test_fly_after_a_confirmed_window_relaxes_again_and_window_zero_is_the_gate_alone():
    logits = (flat(3, 4), peaked(7), peaked(8), flat(5, 6), peaked(1), peaked(2), peaked(9))
    assert verify_fly(rows(*logits), Draft([4, 7, 8, 6, 1, 2]), PARAMS) == Verdict((0, 1, 2, 3, 4, 5), 9)
    gate_only = FlyOptions(entropy=0.1, top_k=5, min_prob=0.05, window=0)
    assert verify_fly(rows(flat(3, 4), peaked(5)), Draft([4]), gate_only) == Verdict((0,), 5)


def test_fly_walks_trees_preferring_the_exact_child():
    # Root children: 9 (implausible) and 4 (plausible mismatch); 4's chain 7 → 8 confirms it.
    draft = Draft([9, 4, 7, 8], parents=[-1, -1, 1, 2])
    logits = (flat(3, 4), peaked(0), peaked(7), peaked(8), peaked(2))
    assert verify_fly(rows(*logits), draft, PARAMS) == Verdict((1, 2, 3), 2)
    # With the target's own token among the children, the exact child wins.
    draft = Draft([4, 3, 7], parents=[-1, -1, 0])
    logits = (flat(3, 4), peaked(7), peaked(6), peaked(1))
    assert verify_fly(rows(*logits), draft, PARAMS) == Verdict((1,), 6)
    # The confirming branch breaks: roll back to the root.
    draft = Draft([9, 4, 7, 5], parents=[-1, -1, 1, 2])
    assert verify_fly(rows(flat(3, 4), peaked(0), peaked(7), peaked(8), peaked(2)), draft, PARAMS) == Verdict((), 3)


# -- typical acceptance ---------------------------------------------------------------------------------


def test_typical_keeps_a_typical_token_and_rejects_an_atypical_one_when_greedy():
    assert verify_typical(rows(flat(3, 4), peaked(6)), Draft([4]), TYPICAL) == Verdict((0,), 6)
    sure = torch.zeros(V)
    sure[3] = 5.0  # p(3) ~ 0.75: p(4) ~ 0.005 is under min(epsilon, delta * exp(-H))
    assert verify_typical(rows(sure, peaked(6)), Draft([4]), TYPICAL) == Verdict((), 3)
    # A tree: the typical child is taken over the atypical one, then the walk goes on along it.
    draft = Draft([9, 4, 6], parents=[-1, -1, 1])
    logits = flat(3, 4)
    logits[9] = -5.0
    assert verify_typical(rows(logits, peaked(0), peaked(6), peaked(2)), draft, TYPICAL) == Verdict((1, 2), 2)


def test_typical_in_seeded_sampling_keeps_the_other_of_two_likely_tokens():
    sampling = SamplingParams(temperature=1.0, seed=5)
    two = torch.zeros(V)
    two[3] = two[4] = 10.0
    chosen = coupled_sample(two, sampling, 5, 7)
    other = 4 if chosen == 3 else 3
    target = rows(two, peaked(6), sampling=sampling, seed=5, first_position=7)
    assert verify_typical(target, Draft([other]), TYPICAL).path == (0,)
    exact = TargetRows(torch.stack([two, peaked(6)]), sampling, seed=5, first_position=7)
    assert exact.choice(0, 7) == chosen  # what coupled verification would emit in its place
    low = two.clone()
    low[other] = 0.0  # now p(other) ~ 0: rejected, and the target's own sample is emitted
    assert verify_typical(
        rows(low, peaked(6), sampling=sampling, seed=5, first_position=7), Draft([other]), TYPICAL
    ) == (Verdict((), 3 if other == 4 else 4))


@pytest.mark.parametrize(
    "sampling", [GREEDY, SamplingParams(temperature=0.9, top_k=20, seed=11)], ids=["greedy", "coupled"]
)
@pytest.mark.parametrize("verify, options", [(verify_fly, PARAMS), (verify_typical, TYPICAL)], ids=["fly", "typical"])
def test_relaxed_verdicts_extend_the_exact_one_on_random_trees(verify, options, sampling):
    """Both extend exact verification (greedy matching, or coupled verification when seeded): the exact path is
    a prefix of theirs, and where they stop as early they emit the same token."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = 1 + trial % 7
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)] if trial % 2 else None
        logits = torch.randn(n + 1, V, generator=gen) * (0.5 + trial % 4)
        tokens = [int(t) for t in logits[torch.randint(0, n + 1, (n,), generator=gen)].topk(3).indices[:, trial % 3]]
        draft = Draft(tokens, parents=parents)
        if sampling.greedy:
            exact = verify_greedy(argmax_last(logits), draft)
        else:
            exact = verify_coupled(logits, draft, sampling, sampling.seed, 40)
        relaxed = verify(TargetRows(logits, sampling, sampling.seed, 40), draft, options)
        assert relaxed.path[: len(exact.path)] == exact.path
        if len(relaxed.path) == len(exact.path):
            assert relaxed == exact


# -- registry, configuration, engine, CLI, server ---------------------------------------------------------


def test_registry_says_which_verifiers_are_lossless():
    assert [n for n, info in verifiers().items() if info.lossless] == ["exact", "optimal-md", "spectr"]
    assert not is_lossless("fly") and not is_lossless("typical") and not is_lossless("judge")
    assert "lossy" in format_verifiers() and "lossless" in format_verifiers()
    with pytest.raises(SpecDecodeError, match="unknown verifier 'jugde'"):
        check_verifier("jugde")
    with pytest.raises(SpecDecodeError, match="unknown verifier"):
        GenerationConfig(verifier="nope")
    with pytest.raises(SpecDecodeError, match="window"):
        FlyOptions(window=-1)
    with pytest.raises(SpecDecodeError, match="unknown verifier option"):
        parse_verifier("fly", {"windw": 2})


def test_exact_is_the_default_and_relaxed_requests_are_labelled_lossy(tiny_target):
    generator = SpeculativeGenerator.build(tiny_target, "pld")
    prompt = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2 w3"
    plain = SpeculativeGenerator.build(tiny_target, "none").generate(prompt, max_new_tokens=24)
    exact = generator.generate(prompt, max_new_tokens=24)
    assert exact.token_ids == plain.token_ids
    assert exact.stats.to_json()["lossless"] is True and exact.stats.to_json()["verifier"] == "exact"
    for name in ("fly", "typical"):
        generator.reset_drafter()
        options = {"entropy": 0.0, "top_k": 50, "min_prob": 0.0} if name == "fly" else {}
        result = generator.generate(prompt, max_new_tokens=24, verifier=name, verifier_options=options)
        stats = result.stats
        assert stats.to_json()["lossless"] is False and stats.verifier == name and "LOSSY" in stats.summary()
        assert stats.new_tokens == stats.steps + stats.accepted_tokens
    with pytest.raises(SpecDecodeError, match="unknown verifier"):
        generator.generate(prompt, verifier="bogus")


def test_target_verifier_dispatches_per_sequence(tiny_target):
    """One batch, one forward: an exact and a fly sequence each get their own verdict."""
    from specdecode.draft_length.base import FixedLength
    from specdecode.drafters import create_drafter
    from specdecode.engine import read_prompt, start_sequence

    backend, drafter = tiny_target.backend, create_drafter("none", tiny_target)
    pool = backend.new_pool()
    pool.reserve(2, 64)
    loose = FlyOptions(entropy=0.0, top_k=64, min_prob=0.0, window=0)
    seqs = [
        start_sequence(
            backend,
            drafter,
            [5, 6, 7],
            GenerationConfig(verifier=v),
            frozenset(),
            FixedLength(4),
            pool.allocate(),
        )
        for v in (VerifierChoice("exact"), VerifierChoice("fly", loose))
    ]
    for seq in seqs:
        read_prompt(backend, seq)
    logits = backend.forward(torch.tensor([5, 6, 7]), backend.new_cache()).logits[-1]
    wrong = int(logits.argsort()[-2])  # the target's second choice: exact rejects it, loose fly keeps it
    checked = TargetVerifier(backend)(seqs, [Draft([wrong]), Draft([wrong])], [])
    assert checked[0].verdict.path == () and checked[0].verdict.next_token == int(logits.argmax())
    assert checked[1].verdict.path == (0,)


def test_cli_refuses_an_unknown_verifier_in_one_line_and_json_says_lossless(capsys, tiny_dirs):
    assert_one_line_error(capsys, ["generate", "w1 w2", "--verifier", "jugde"], "unknown verifier 'jugde'")
    assert_one_line_error(capsys, ["generate", "w1 w2", "--verifier-option", "bad"], "--verifier-option")
    argv = ["generate", "w1 w2 w3 w1 w2", "--model", str(tiny_dirs["target"]), "--max-new-tokens", "8", "--json"]
    for verifier, lossless in (("exact", True), ("typical", False)):
        assert main([*argv, "--verifier", verifier]) == 0
        stats = json.loads(capsys.readouterr().out)["stats"]
        assert stats["lossless"] is lossless and stats["verifier"] == verifier
    assert_one_line_error(capsys, ["generate", "w1 w2", "--verifier", "fly:window=x"], "window must be an integer")
    assert main([*argv, "--verifier", "fly:window=2:entropy=0.5"]) == 0  # options inline, as bench quality takes them
    assert json.loads(capsys.readouterr().out)["stats"]["verifier"] == "fly"
    assert main(["verifiers"]) == 0
    assert "fly" in capsys.readouterr().out


def test_server_takes_a_verifier_per_request_and_refuses_unknown_ones(tiny_target):
    generator = SpeculativeGenerator.build(tiny_target, "pld")
    service = Service(generator, {"pld": generator.drafter}, ServerConfig(model_name="tiny"))
    with serving(create_app(service)) as base:
        url = f"{base}/v1/completions"
        bad = httpx.post(url, json={"prompt": "w1 w2", "verifier": "jugde"})
        assert bad.status_code == 400 and "unknown verifier" in bad.json()["error"]["message"]
        for verifier, lossless in (("fly", False), (None, True)):
            body = {"prompt": "w1 w2 w3 w1 w2", "max_tokens": 8, **({"verifier": verifier} if verifier else {})}
            reply = httpx.post(url, json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            spec = reply.json()["metrics"]["speculative_decoding"]
            assert spec["lossless"] is lossless and spec["verifier"] == (verifier or "exact")
        metrics = httpx.get(f"{base}/metrics").text
        assert 'specdecode:verifier_requests_total{lossless="false",verifier="fly"} 1.0' in metrics
        assert 'specdecode:verifier_requests_total{lossless="true",verifier="exact"} 1.0' in metrics


def test_demo_compares_a_relaxed_verifier_with_exact_plain_decoding(capsys, tiny_dirs):
    argv = ["demo", "--model", str(tiny_dirs["target"]), "--verifier", "typical", "--max-new-tokens", "12"]
    assert main(argv) == 0  # a difference is the relaxed verifier's cost, not a failure
    lines = capsys.readouterr().out.splitlines()
    plain = next(line for line in lines if line.startswith("plain decoding"))
    assert "LOSSY" not in plain and "verifier typical is LOSSY" in lines[-1]


def test_python_api_load_takes_a_verifier_and_refuses_unknown_ones_before_loading(tiny_dirs):
    import specdecode

    with pytest.raises(SpecDecodeError, match="unknown verifier"):
        specdecode.load("no-such-model", verifier="jugde")  # refused before the model is looked up
    generator = specdecode.load(str(tiny_dirs["target"]), verifier="fly", max_new_tokens=6)
    assert generator.defaults.verifier.name == "fly"
    assert generator.generate("w1 w2 w1 w2").stats.to_json()["lossless"] is False
    assert generator.generate("w1 w2 w1 w2", verifier="exact").stats.lossless


def test_listing_verifiers_imports_no_torch():
    import subprocess
    import sys

    code = "import sys; from specdecode.cli import main; main(['verifiers']); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0].startswith("exact     lossless") and out.splitlines()[-1] == "False"


class SecondChoiceDrafter(Drafter):
    """Drafts the target's second choice for the next token, then the target's greedy continuation of it: a
    plausible alternative that the target then agrees with — what FLy keeps.  ``tree``: behind a sibling that is
    the target's least likely token (which the gate must never take)."""

    def __init__(self, target, tree: bool) -> None:
        super().__init__(target)
        self.tree = tree

    def session(self, request):
        return StatelessSession(self.propose)

    def _logits(self, context: list[int]) -> torch.Tensor:
        backend = self.target.backend
        return backend.forward(torch.tensor(context), backend.new_cache()).logits[-1]

    def propose(self, context, max_tokens) -> Draft:
        first = self._logits(context)
        chain = [int(first.argsort()[-2])]
        while len(chain) < max_tokens:
            chain.append(int(self._logits(context + chain).argmax()))
        if not self.tree:
            return Draft(chain)
        return Draft([int(first.argmin()), *chain], parents=[-1, -1, *range(1, len(chain))])


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_fly_output_through_the_engine_departs_only_where_the_gate_and_window_allow(tiny_target, tree):
    """Replayed by one plain forward over the output: every token that is not the target's argmax was plausible
    there (top-k, a flat row) and is followed by ``window`` argmax tokens — so the cache held the right context
    after every relaxed acceptance, chains and trees alike."""
    from specdecode.engine import speculative_decode

    params = FlyOptions(entropy=0.1, top_k=5, min_prob=0.0, window=2)
    prompt = [12, 13, 14, 12, 13, 14, 12, 13, 14, 12, 13]
    config = GenerationConfig(
        max_new_tokens=40, num_draft_tokens=4, ignore_eos=True, verifier=VerifierChoice("fly", params)
    )
    backend, drafter = tiny_target.backend, SecondChoiceDrafter(tiny_target, tree)
    out = [t for chunk in speculative_decode(backend, drafter, prompt, config) for t in chunk]
    logits = backend.forward(torch.tensor(prompt + out), backend.new_cache()).logits[len(prompt) - 1 : -1]
    probs = torch.softmax(logits.float(), dim=-1)
    departures = [i for i, token in enumerate(out) if token != int(logits[i].argmax())]
    for i in departures:
        p = probs[i]
        assert int((p > p[out[i]]).sum()) < params.top_k
        assert float(torch.special.entr(p).sum()) >= params.entropy * math.log(p.shape[-1])
        after = [j for j in departures if i < j <= i + params.window]
        assert not after, (i, departures)  # (the token limit may cut a confirmed window short at the end)
    assert len(departures) >= 4  # one per step where the gate let the second choice through
