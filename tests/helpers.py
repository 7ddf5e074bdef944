"""Helpers shared by several test files (fixtures stay in conftest.py): the prompts and reference greedy
decoding of the tiny models, a drafting session for a prompt, a few tiny architectures, and a toy
bigram "model" with the chi-square machinery the lossless-sampling tests use."""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdecode.batch_engine import BatchEngine, BatchRequest
from specdecode.bench.cli import add_bench_command
from specdecode.cli import main
from specdecode.config import GenerationConfig
from specdecode.data.tasks import Prompt, Task
from specdecode.draft_length.base import FixedLength
from specdecode.draft_length.factory import make_policy
from specdecode.drafters import create_drafter
from specdecode.drafters.base import Drafter, DraftRequest, DraftSession, StatelessSession
from specdecode.engine import DecodeOutcome, speculative_decode, verification_input
from specdecode.errors import SpecDecodeError
from specdecode.models.base import (
    CausalLM,
    DecoderShape,
    ForwardOutput,
    HiddenStates,
    KVCache,
    KVPool,
    SequenceInput,
)
from specdecode.sampling_params import SamplingParams
from specdecode.types import Draft
from tiny_models import tiny_llama

PROMPTS = [
    [5, 17, 22, 9, 30, 41],
    [12, 13, 14, 12, 13, 14, 12, 13],  # repetitive: prompt lookup finds matches
    [7],
]


def hf_greedy(loaded, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding by transformers itself: the reference every lossless drafter must match."""
    model = loaded.backend.model
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def check_own_token_figures(loaded, measured: Callable, own_rows: int = 30, start: int = 5):
    """A trainer's held-out figures (``measured(ids)``: its ``HeldOutAcceptance`` on one sequence): a sequence the
    target wrote itself (greedy from ``start``) is all own rows and both figures agree; the control, random tokens
    the target would not have written, are almost never read as its own.  Returns the figures of the first."""
    own = measured([start, *hf_greedy(loaded, [start], 30)])
    assert own.own_rows == own_rows and own.own == own.every
    foreign = measured(torch.randint(3, 60, (31,), generator=torch.Generator().manual_seed(0)).tolist())
    assert foreign.own_rows <= 3
    return own


def run(target, drafter, prompt, **config) -> tuple[list[int], DecodeOutcome]:
    """One request through the engine (EOS ignored); its tokens and outcome."""
    outcome = DecodeOutcome()
    tokens = [
        t
        for chunk in speculative_decode(
            target.backend, drafter, prompt, GenerationConfig(ignore_eos=True, **config), outcome=outcome
        )
        for t in chunk
    ]
    return tokens, outcome


def session_for(drafter: Drafter, prompt: list[int], sampling: SamplingParams | None = None, **request) -> DraftSession:
    """A drafting session of ``drafter`` for a request with ``prompt`` (and ``seed``, ``stop_rule``, ...)."""
    return drafter.session(DraftRequest(tuple(prompt), sampling or SamplingParams(), **request))


# -- tiny cell benchmarks (bench throughput, bench serve) -------------------------------------------

BENCH_MAX_NEW = 8  # new tokens per request in the tiny cell benchmarks


def assert_tree_nodes_get_their_branch_fed_alone(backend: CausalLM, context: list[int], draft: Draft) -> None:
    """Every node of ``draft``, verified after ``context`` as the engine lays a tree out, gets bitwise the logits
    plain decoding of its own branch gives it, fed one token at a time after the same context."""
    prompt = torch.tensor(context[:-1])

    def prefilled() -> KVCache:
        cache = backend.new_cache()
        backend.forward_batch([SequenceInput(prompt, cache, invariant=False)])
        return cache

    tree = backend.forward_batch([verification_input(context, draft, prefilled())])[0].logits
    parents = draft.parent_list
    cache = prefilled()
    for node in range(len(draft.tokens)):
        branch = [node]
        while parents[branch[-1]] >= 0:
            branch.append(parents[branch[-1]])
        cache.crop(len(prompt))
        for token in [context[-1], *(draft.tokens[i] for i in reversed(branch))]:
            alone = backend.forward_batch([SequenceInput(torch.tensor([token]), cache)])[0].logits[0]
        assert torch.equal(tree[node + 1], alone), f"node {node} of {len(draft.tokens)} after {len(context)} tokens"


class RandomOracleTrees(Drafter):
    """Hides the plain greedy continuation ``truth`` in random trees: its next tokens as one branch of random
    depth (wrong from a random depth on, now and then), wrong branches off random nodes, and the nodes in a
    random order that keeps parents first, so that a path's nodes are seldom adjacent in the tree's layout.
    Run long enough to cross a key bucket, it gives verification and cache compaction every tree shape the
    trained drafters make: the engine must still emit exactly ``truth``."""

    def __init__(self, target, truth: list[int], prompt_len: int, vocab: int, seed: int = 0) -> None:
        super().__init__(target)
        self.truth, self.prompt_len, self.vocab = truth, prompt_len, vocab
        self.rng = random.Random(seed)

    def session(self, request: DraftRequest) -> DraftSession:
        return StatelessSession(self.propose)

    def propose(self, context: list[int], max_tokens: int) -> Draft:
        rng = self.rng
        done = len(context) - self.prompt_len
        branch = list(self.truth[done : done + rng.randint(1, max_tokens)])
        if branch and rng.random() < 0.3:
            cut = rng.randrange(len(branch))
            branch[cut] = (branch[cut] + 1 + rng.randrange(self.vocab - 1)) % self.vocab
        tokens, parents = [], []
        for token in branch:
            parents.append(len(tokens) - 1)
            tokens.append(token)
        for _ in range(rng.randint(0, 12)):  # wrong branches (a token equal to a right one is fine too)
            parents.append(rng.randrange(-1, len(tokens)))
            tokens.append(rng.randrange(self.vocab))
        return _shuffled_keeping_parents_first(tokens, parents, rng)


def _shuffled_keeping_parents_first(tokens: list[int], parents: list[int], rng: random.Random) -> Draft:
    """The same tree with its nodes in a random order in which every parent still comes before its children."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    order, ready = [], list(children.get(-1, []))
    while ready:
        node = ready.pop(rng.randrange(len(ready)))
        order.append(node)
        ready.extend(children.get(node, []))
    index_of = {old: new for new, old in enumerate(order)}
    return Draft(tokens=[tokens[i] for i in order], parents=[index_of.get(parents[i], -1) for i in order])


def tiny_bench_tasks() -> list[Task]:
    """3 prompts from 2 tasks in the tiny tokenizer's vocabulary: repetitive ones (prompt lookup drafts) of
    different lengths (the transformers batched peer pads)."""
    words = "w1 w2 w3 w4 w5 w1 w2 w3 w4 w5 w1 w2 w3 here w7 w8 w9 w7 w8"
    return [
        Task("edit", "edit", [Prompt(f"edit/{i}", f"{words} w{10 + i} w{20 + i}", True) for i in range(2)]),
        Task("mt-bench", "chat", [Prompt("mt/0", "w30 w31 w32 stop", False)]),
    ]


def tiny_bench_settings(resolve_settings, tiny_dirs, out, **values):
    """``resolve_settings`` of a cell benchmark for the tiny target: none and pld on the tasks of
    :func:`tiny_bench_tasks`, :data:`BENCH_MAX_NEW` tokens, one thread, results in ``out``; ``values`` add to
    or override these."""
    defaults = {
        "model": str(tiny_dirs["target"]),
        "methods": "none,pld",
        "tasks": "edit,mt-bench",
        "max_new_tokens": BENCH_MAX_NEW,
        "threads": 1,
        "out": str(out),
    }
    return resolve_settings(**(defaults | values))


def cells_by(results, column: str) -> dict:
    """A cell benchmark's cells by (method, value of ``column``), in the results' order."""
    return {(c["method"], c[column]): c for c in results["cells"]}


def saved_report(settings, results) -> str:
    """Check that results.json in ``settings.out`` holds the cells a run returned; results.md's text."""
    on_disk = json.loads((settings.out / "results.json").read_text())
    assert on_disk["cells"] == results["cells"]
    return (settings.out / "results.md").read_text()


def forbid(monkeypatch, module, *names: str) -> None:
    """Make ``module``'s ``names`` fail the test when called: everything is measured, nothing may run."""

    def fail(*args, **kwargs):
        pytest.fail("everything is measured: nothing may run")

    for name in names:
        monkeypatch.setattr(module, name, fail)


def without_cell(settings, out, column: str, missing: tuple[str, int]):
    """``out`` holding the results.json of ``settings.out`` less the cell ``missing`` (method, ``column`` value)."""
    out.mkdir()
    partial = json.loads((settings.out / "results.json").read_text())
    partial["cells"] = [c for c in partial["cells"] if (c["method"], c[column]) != missing]
    (out / "results.json").write_text(json.dumps(partial))
    return out


def assert_one_line_error(capsys, argv: list[str], message: str) -> None:
    """``specdecode argv`` exits 2 with ``message`` in a one-line error."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdecode: error: ") and message in err and "\n" not in err


def bench_parser() -> argparse.ArgumentParser:
    """The ``specdecode`` parser with only the ``bench`` command and its sub-commands."""
    parser = argparse.ArgumentParser(prog="specdecode")
    add_bench_command(parser.add_subparsers(dest="command", required=True))
    return parser


# -- tiny architectures ------------------------------------------------------------------------------


def tiny_llama3():
    return tiny_llama(0, layers=3)


def tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.3,
        )
    )


def tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # A sliding window far shorter than the generation: rollback must still be exact.
    return Gemma3ForCausalLM(
        Gemma3TextConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            max_position_embeddings=256,
            initializer_range=0.3,
        )
    )


# -- statistics -------------------------------------------------------------------------------------

DRAWS = 25_000
PASS_P = 1e-3  # seeded, so deterministic; a correct verifier passes comfortably
FAIL_P = 1e-6


def chi2_pvalue(observed: np.ndarray, probs) -> float:
    """Chi-square goodness of fit of counts against a distribution (renormalised in float64)."""
    expected = np.asarray(probs, dtype=np.float64)
    return float(chisquare(observed, expected / expected.sum() * observed.sum()).pvalue)


def chain_pvalues(counts: np.ndarray, expected_rows: np.ndarray) -> list[float]:
    """One chi-square test per (position in step, previous token) with enough samples; counts are
    [position in step, previous token, next token]."""
    pvalues = []
    for position in range(counts.shape[0]):
        for prev in range(counts.shape[1]):
            row = counts[position, prev]
            support = expected_rows[prev] > 0
            assert row[~support].sum() == 0, "a token outside top-k/top-p was emitted"
            if row.sum() >= 500 and support.sum() > 1:
                pvalues.append(chi2_pvalue(row[support], expected_rows[prev][support]))
    return pvalues


# -- a toy Markov-chain backend -----------------------------------------------------------------------

V = 5


class ListCache(KVCache):
    """The "cache" of a bigram model: the tokens it has seen."""

    def __init__(self, pool: ListPool) -> None:
        self.pool = pool
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def crop(self, length: int) -> None:
        del self.tokens[length:]

    def _gather(self, start: int, offsets: list[int]) -> None:
        self.tokens[start:] = [self.tokens[start + offset] for offset in offsets]

    def release(self) -> None:
        self.pool.caches.discard(self)


class ListPool(KVPool):
    def __init__(self) -> None:
        self.caches: set[ListCache] = set()

    def allocate(self) -> ListCache:
        cache = ListCache(self)
        self.caches.add(cache)
        return cache

    @property
    def active(self) -> int:
        return len(self.caches)


class BigramLM(CausalLM):
    """Next-token logits depend on the current token only: the exact distribution is known."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.name, self.vocab_size, self.max_context, self.num_layers = "bigram", V, 10**9, 1
        self.eos_token_ids = ()

    def new_pool(self) -> ListPool:
        return ListPool()

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.table[tokens]

    def forward_batch(self, inputs: list[SequenceInput]) -> list[ForwardOutput]:
        outputs = []
        for item in inputs:
            cache = item.cache
            positions = item.positions
            if positions is None:
                positions = torch.arange(cache.length, cache.length + len(item.tokens))
            logits = self.logits(item.tokens, positions)
            cache.tokens.extend(item.tokens.tolist())
            outputs.append(ForwardOutput(logits=logits[item.logits_rows] if item.logits_rows is not None else logits))
        return outputs


class BigramFeatures(BigramLM, HiddenStates):
    """The bigram toy with hidden states, for heads that draft from features: every layer's "feature" of a
    token is a fixed random vector (the exact target distribution stays known)."""

    hidden_size = 8

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__(table)
        self.vectors = torch.randn(V, self.hidden_size, generator=torch.Generator().manual_seed(5))
        self.dtype = torch.float32

    def decoder_shape(self) -> DecoderShape:
        return DecoderShape(8, 2, 1, 4, 16, 1e-6, 10000.0)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.vectors[tokens]

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def forward_batch(self, inputs):
        outputs = super().forward_batch(inputs)
        return [
            ForwardOutput(out.logits, torch.cat([self.vectors[item.tokens]] * len(item.hidden_layers), dim=-1))
            if item.hidden_layers
            else out
            for item, out in zip(inputs, outputs)
        ]


def random_eagle_head(backend, draft_vocab: int, seed: int = 0):
    """An untrained EAGLE head for ``backend`` drafting ``draft_vocab`` random token ids."""
    from specdecode.heads.eagle import EagleConfig, EagleHead

    config = EagleConfig.for_target(backend.decoder_shape(), backend.num_layers, backend.vocab_size, draft_vocab)
    torch.manual_seed(seed)
    head = EagleHead(config)
    head.set_draft_vocabulary(torch.randperm(backend.vocab_size)[:draft_vocab])
    return head


def random_falcon_head(backend, draft_vocab: int, seed: int = 0, block: int = 2):
    """An untrained Falcon head for ``backend`` drafting ``draft_vocab`` random token ids, ``block`` per pass."""
    from specdecode.heads.falcon import FalconConfig, FalconHead

    shape = backend.decoder_shape()
    config = FalconConfig.for_target(shape, backend.num_layers, backend.vocab_size, draft_vocab, block)
    torch.manual_seed(seed)
    head = FalconHead(config)
    head.set_draft_vocabulary(torch.randperm(backend.vocab_size)[:draft_vocab])
    return head


def random_ctc_head(backend, draft_vocab: int, seed: int = 0, slots: int = 8):
    """An untrained CTC head for ``backend`` (random blocks, LM head and blank) drafting ``draft_vocab`` random ids."""
    from specdecode.heads.ctc import CTCConfig, CTCHead

    torch.manual_seed(seed)
    head = CTCHead(CTCConfig(backend.hidden_size, slots, backend.vocab_size, draft_vocab, backend.num_layers))
    head.token_map.copy_(torch.randperm(backend.vocab_size)[:draft_vocab].sort().values)
    return head


class WrongBranchTree(Drafter):
    """Knows the expected continuation and hides it in a tree behind a wrong sibling subtree (each true token mapped
    by ``wrong_of``): the wrong branch is verified and rejected, and a row on the right branch must not count its
    tokens as its prefix (processing, a grammar's matcher)."""

    def __init__(self, target, truth: list[int], prompt_len: int, wrong_of: Callable[[int], int]) -> None:
        super().__init__(target)
        self.truth, self.prompt_len, self.wrong_of = truth, prompt_len, wrong_of

    def session(self, request):
        return StatelessSession(self.propose)

    def propose(self, context, max_tokens) -> Draft:
        done = len(context) - self.prompt_len
        right = self.truth[done : done + max_tokens]
        if not right:
            return Draft(tokens=[])
        wrong = [self.wrong_of(token) for token in right]
        parents = [*range(-1, len(wrong) - 1), -1, *range(len(wrong), len(wrong) + len(right) - 1)]
        return Draft(tokens=wrong + right, parents=parents)  # the wrong chain first, the right one a second root


#: ``rasd`` where every drafter is built: a small datastore of the tiny vocabulary's words, English, code and JSON.
RASD_OPTIONS = {"datastore": str(Path(__file__).with_name("rasd_datastore.jsonl"))}


def untrained_drafter_options(target, draft, draft_vocab: int, exit_layer: int) -> dict[str, dict]:
    """What each drafter that needs trained parts (or a datastore) is created with, untrained (greedy output is exact
    whatever they draft): ``draft`` as the draft model, a Kangaroo adapter at ``exit_layer``, heads drafting
    ``draft_vocab`` ids, ``rasd`` the tests' datastore."""
    from specdecode.drafters.kangaroo import KangarooAdapter
    from specdecode.heads.medusa import heads_for_target

    backend = target.backend
    return {
        "rasd": RASD_OPTIONS,
        "draft-model": {"draft_model": draft},
        "hsd": {"draft_model": draft},
        "kangaroo": {"adapter": KangarooAdapter.for_backend(backend, exit_layer=exit_layer)},
        "eagle": {"head": random_eagle_head(backend, draft_vocab)},
        "medusa": {"heads": heads_for_target(backend, "medusa", 3, torch.arange(draft_vocab))},
        "hydra": {"heads": heads_for_target(backend, "hydra", 3, torch.arange(draft_vocab))},
        "falcon": {"head": random_falcon_head(backend, draft_vocab)},
        "ctc": {"head": random_ctc_head(backend, draft_vocab)},
    }


def random_heads(backend, kind: str, draft_vocab: int, seed: int = 0, num_heads: int = 4):
    """Untrained Medusa or Hydra heads for ``backend`` drafting ``draft_vocab`` random token ids."""
    from specdecode.heads.medusa import heads_for_target

    torch.manual_seed(seed)
    return heads_for_target(backend, kind, num_heads, torch.randperm(backend.vocab_size)[:draft_vocab])


def sharpened_choice(*args):
    """A head drafter's ``choose_from_subset`` that reports the distribution it sampled from sharpened (squared and
    renormalised), as a drafter would that forgot the temperature: the broken control of the chi-square tests, where
    rejection sampling then keeps too many likely tokens."""
    from specdecode.drafters._vocab import choose_from_subset

    token, confidence, probs = choose_from_subset(*args)
    return token, confidence, None if probs is None else probs**2 / (probs**2).sum()


def assert_head_drafter_samples_exactly(
    model: BigramFeatures, table: torch.Tensor, drafter, draws: int = DRAWS, verifier: str = "exact"
) -> None:
    """Rejection sampling (or ``verifier``) with a head-based ``drafter`` on the bigram toy: every (position in step,
    previous token) stratum of ``draws`` tokens fits the target's processed distribution, and drafts were accepted."""
    pvalues = head_drafter_pvalues(model, table, drafter, draws, verifier)
    assert len(pvalues) >= 8
    assert min(pvalues) > PASS_P / len(pvalues), pvalues


def head_drafter_pvalues(
    model: BigramFeatures, table: torch.Tensor, drafter, draws: int, verifier: str = "exact"
) -> list[float]:
    """The chi-square p-values of :func:`assert_head_drafter_samples_exactly`'s strata (drafts must be accepted):
    what a broken drafter's control shows failing."""
    from specdecode.sampling import sampling_probs

    sampling = SamplingParams(temperature=0.9, top_k=4)
    counts = np.zeros((4, V, V))
    produced, seed = 0, 0
    while produced < draws:
        params = SamplingParams(0.9, 4, seed=seed, coupled=False)  # coupling would bypass rejection sampling
        config = GenerationConfig(max_new_tokens=500, num_draft_tokens=3, sampling=params, verifier=verifier)
        previous = 0
        for chunk in speculative_decode(model, drafter, [0, 1], config):
            for position, token in enumerate(chunk):
                counts[position, previous, token] += 1
                previous = token
            produced += len(chunk)
        seed += 1
    assert counts[1:].sum() > 0  # drafts were accepted
    return chain_pvalues(counts, sampling_probs(table, sampling).numpy())


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """``app`` served for real by uvicorn on a free loopback port in a background thread; yields its base URL."""
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def fixed_depth_engine(target, drafter: str, k: int, **options) -> BatchEngine:
    """A continuous-batching engine of at most 4 sequences on ``target`` (no end-of-sequence tokens) whose every
    request drafts ``k`` tokens with ``drafter``; ``options`` go to :class:`BatchEngine` (prefill chunk, budget)."""
    return BatchEngine(
        target.backend,
        create_drafter(drafter, target),
        lambda config, drafter: FixedLength(k),
        frozenset(),
        max_batch_size=4,
        **options,
    )


def assert_batched_greedy_is_solo(target, drafter, prompts: list[list[int]], batch_size: int) -> None:
    """Every prompt decoded greedily with ``drafter`` in a continuous batch of at most ``batch_size`` sequences gives
    transformers' own greedy output of that prompt alone (20 tokens, EOS ignored)."""
    engine = BatchEngine(
        target.backend, drafter, lambda config, d: make_policy(config.num_draft_tokens), frozenset(), batch_size
    )
    for i, prompt in enumerate(prompts):
        engine.submit(BatchRequest(prompt, GenerationConfig(max_new_tokens=20, ignore_eos=True), tag=i))
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for event in engine.run():
        got[event.tag] += event.new_tokens
    for i, prompt in enumerate(prompts):
        assert got[i] == hf_greedy(target, prompt, 20)


def assert_saved_head_loads_and_drafts_the_same(target, drafter: str, head, directory: Path, load) -> None:
    """A head saved in ``directory``: ``load`` gives its weights back, ``drafter`` drafts the same from the object and
    from the directory, and a tampered weights file is refused by its SHA-256."""
    loaded = load(directory)
    for name, value in head.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    drafts = []
    for given in (head, str(directory)):
        drafting = create_drafter(drafter, target, head=given)
        tokens, outcome = run(target, drafting, PROMPTS[0], max_new_tokens=12, num_draft_tokens=4)
        drafts.append((tokens, outcome.stats.drafted_tokens, outcome.stats.accepted_tokens))
    assert drafts[0] == drafts[1]
    (directory / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(SpecDecodeError, match="SHA-256"):
        load(directory)


class ParityBigramLM(BigramLM):
    """The next token depends on the current token *and* on the parity of its position, which neither an n-gram key
    nor a datastore can see: a drafter's distributions stay wrong (a mix of both tables) and many drafts are
    rejected, so the chi-square test has the power to catch a wrong probability row."""

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions % 2, tokens]


def parity_counts(model, drafter, sampling: SamplingParams, tokens_wanted: int) -> tuple[np.ndarray, int, int]:
    """Counts [parity of the previous token's position, position in step, previous token, next token] of
    ``tokens_wanted`` tokens from ``drafter`` kept across many seeded, uncoupled requests of 3-token drafts; and the
    tokens produced and steps taken."""
    counts = np.zeros((2, 4, V, V))
    produced = steps = seed = 0
    while produced < tokens_wanted:
        config = GenerationConfig(
            max_new_tokens=1000,
            num_draft_tokens=3,
            sampling=SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed, coupled=False),
        )
        sequence = [0]
        for chunk in speculative_decode(model, drafter, sequence[:], config):
            for step_position, token in enumerate(chunk):
                counts[(len(sequence) - 1) % 2, step_position, sequence[-1], token] += 1
                sequence.append(token)
            produced += len(chunk)
            steps += 1
        seed += 1
    return counts, produced, steps
