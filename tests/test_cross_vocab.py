"""Cross-vocabulary drafting (``draft-model`` with ``vocab_mapping=intersection|text``): the token bytes and
the map between two vocabularies, the drafter's copy of the context, and end to end — greedy output equal
to plain decoding, ``intersection`` sampling exact by chi-square (and a broken control that fails)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import ByteLevelBPETokenizer, SentencePieceBPETokenizer
from transformers import PreTrainedTokenizerFast

import specdecode.drafters.cross_vocab
from helpers import DRAWS, FAIL_P, PASS_P, BigramLM, V, assert_one_line_error, chain_pvalues, hf_greedy, run
from specdecode.config import GenerationConfig, SamplingParams
from specdecode.drafters import create_drafter
from specdecode.drafters._vocab_map import ContextTranslator, TokenTable, build_vocab_map, complete_utf8
from specdecode.drafters.cross_vocab import draft_to_target
from specdecode.engine import speculative_decode
from specdecode.errors import SpecDecodeError, VocabularyMismatchError
from specdecode.models.loading import LoadedModel
from specdecode.sampling import sampling_probs
from tiny_models import bpe_tokenizer, tiny_model

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "def f(x): return x + 1"] * 20
TEXTS = [" hello world the fox", "def f(x):\n\treturn x+1 # ä 漢 😀", "hello</s>there<s>"]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE (``Ġ`` is the space), as SmolLM2 and Qwen use."""
    trained = ByteLevelBPETokenizer()
    trained.train_from_iterator(CORPUS, vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=trained._tokenizer, bos_token="<s>", eos_token="</s>")


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece style BPE (``▁`` is the space, one prepended to the text), another vocabulary."""
    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(CORPUS, vocab_size=120, special_tokens=["<s>", "</s>", "<unk>"], show_progress=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=trained._tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


# -- token bytes and the map ------------------------------------------------------------------------


def test_token_bytes_spell_the_text():
    byte_level, sentencepiece = byte_level_tokenizer(), metaspace_tokenizer()
    for text in TEXTS:
        assert TokenTable.of(byte_level).text(byte_level.encode(text)) == text.encode()
    for text in [TEXTS[0], "def f(x): return x"]:  # characters it knows; it prepends a space
        assert TokenTable.of(sentencepiece).text(sentencepiece.encode(text)) == (" " + text.lstrip()).encode()


def test_byte_fallback_and_wordpiece_pieces():
    from specdecode.drafters._vocab_map import piece_bytes

    sentencepiece = frozenset({"Metaspace", "ByteFallback"})
    assert piece_bytes("▁the", sentencepiece) == (b" the", False)
    assert piece_bytes("<0x0A>", sentencepiece) == (b"\n", True)
    assert piece_bytes("Ġthe", frozenset({"ByteLevel"})) == (b" the", False)
    assert piece_bytes("Ã¤", frozenset({"ByteLevel"})) == ("ä".encode(), False)
    assert piece_bytes("##ing", frozenset({"WordPiece"})) == (b"ing", False)


def test_piece_encoding_guessed_without_a_decoder():
    from specdecode.drafters._vocab_map import _guess_kinds

    assert "Metaspace" in _guess_kinds(["<unk>", "▁the", "<0x0A>"])
    assert _guess_kinds(["Ġthe", "a"]) == frozenset({"ByteLevel"})
    assert _guess_kinds(["a", None]) == frozenset()


def test_map_pairs_identical_bytes_one_to_one():
    target, draft = byte_level_tokenizer(), metaspace_tokenizer()
    target_table, draft_table = TokenTable.of(target), TokenTable.of(draft)
    vocab_map = build_vocab_map(draft_table, len(draft), target_table, len(target))
    pairs = list(zip(vocab_map.draft_ids.tolist(), vocab_map.target_ids.tolist(), strict=True))
    assert len(pairs) > 40
    assert len({d for d, _ in pairs}) == len({t for _, t in pairs}) == len(pairs)  # one to one
    for d, t in pairs:
        assert draft_table.piece(d) == target_table.piece(t)
        assert (d in draft_table.special) == (t in target_table.special)
    readable = {(draft.convert_ids_to_tokens(d), target.convert_ids_to_tokens(t)) for d, t in pairs}
    assert ("▁fox", "Ġfox") in readable and ("</s>", "</s>") in readable  # ▁ and Ġ are both a space
    assert all(vocab_map.index_of_target[t] == k for k, (_, t) in enumerate(pairs))


def test_specials_map_only_to_specials():
    plain = TokenTable([b"<s>", b"a"], frozenset(), frozenset(), (), list)
    special = TokenTable([b"a", b"<s>"], frozenset({1}), frozenset(), (), list)
    vocab_map = build_vocab_map(plain, 2, special, 2)
    assert vocab_map.draft_ids.tolist() == [1] and vocab_map.target_ids.tolist() == [0]


def test_complete_utf8():
    assert complete_utf8("ä".encode()) == "ä"
    assert complete_utf8("ä".encode()[:1]) is None
    assert complete_utf8(b"\xff a") == "\ufffd a"


def test_merge_cache_learns_target_tokens_spelt_by_several_drafter_tokens():
    from specdecode.drafters._ngram_merge import MergeCache

    target = TokenTable([b"a", b"b", b"c", b"ab", b"abc"], frozenset(), frozenset(), (), list)
    draft = TokenTable([b"a", b"b", b"c"], frozenset(), frozenset(), (), list)
    cache = MergeCache(max_n=3)
    cache.learn(target, [4, 3], draft, [0, 1, 2, 0, 1])  # "abc" "ab" / a b c a b
    assert dict(cache.entries) == {(0, 1, 2): 4, (0, 1): 3}
    single = {0: 0, 1: 1, 2: 2}
    assert cache.convert([0, 1, 2, 0, 1, 2, 2], single) == [4, 4, 2]  # the longest run first
    assert cache.convert([2, 5, 0], single) == [2]  # up to the first token it cannot convert
    cache.learn(target, [4], draft, [0, 1])  # different text: nothing learnt
    small = MergeCache(max_n=3, max_entries=1)
    small.learn(target, [4, 3], draft, [0, 1, 2, 0, 1])
    assert dict(small.entries) == {(0, 1): 3}  # bounded: the least recently used went
    assert +small.members == {0: 1, 1: 1} and cache.members[2] == 1


# -- the drafter's copy of the context --------------------------------------------------------------


def test_translator_follows_a_growing_context_and_freezes_a_prefix():
    target, draft = byte_level_tokenizer(), metaspace_tokenizer()
    target_table = TokenTable.of(target)
    draft = bpe_tokenizer(sorted({c for text in CORPUS + TEXTS for c in text}))  # characters, exact round trip
    translator = ContextTranslator(target_table, TokenTable.of(draft), margin=3)
    ids = target.encode(" ".join(CORPUS[:3]) + TEXTS[1])
    for n in range(1, len(ids) + 1):
        translated = translator.translate(ids[:n])
        text = complete_utf8(target_table.text(ids[:n]))
        if text is None:
            assert translated is None  # the context ends inside a character
        else:
            assert translated == draft.encode(text)
    assert 0 < len(translator._frozen_source) <= len(ids) - 3
    assert translator.translate(ids[:2]) == draft.encode(target.decode(ids[:2]))  # a new context: starts over


def test_text_draft_boundary_merges_with_the_last_context_token():
    pieces = ["h", "e", "l", "o", " ", "x", "he", "hel", "hell", "hello"]
    merges = [("h", "e"), ("he", "l"), ("hel", "l"), ("hell", "o")]
    table = TokenTable.of(bpe_tokenizer(pieces, merges))
    ids = {p: i for i, p in enumerate(pieces)}
    # "hel" + "lo x": tokenised together it would be "hello", but "hel" is committed: the draft alone.
    assert draft_to_target(table, [ids["hel"]], b"lo x") == [ids["l"], ids["o"], ids[" "], ids["x"]]
    # "hel " + "x": the tail comes back unchanged, the draft is what follows it.
    assert draft_to_target(table, [ids["hel"], ids[" "]], b"hello") == [ids["hello"]]


# -- end to end ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair() -> tuple[LoadedModel, LoadedModel]:
    return tiny_model(byte_level_tokenizer(), seed=0, layers=3), tiny_model(metaspace_tokenizer(), seed=1)


@pytest.mark.parametrize("mapping", ["intersection", "text", "ngram"])
def test_greedy_equals_plain_decoding(pair, mapping):
    target, draft = pair
    drafter = create_drafter("draft-model", target, draft_model=draft, vocab_mapping=mapping)
    for text in ["hello world", "def f(x):", "the lazy dog ä"]:
        prompt = target.tokenizer.encode(text)
        tokens, outcome = run(target, drafter, prompt, max_new_tokens=24, num_draft_tokens=4)
        assert tokens == hf_greedy(target, prompt, 24)
        assert outcome.stats.drafted_tokens > 0


@pytest.mark.parametrize("mapping", ["intersection", "text", "ngram"])
def test_seeded_sampling_gives_plain_decodings_text(pair, mapping):
    """Coupled verification makes a seed's tokens a function of the seed and the target alone: drafting
    through either mapping (intersection: Gumbel-max over the intersection with the target's noise)
    must give exactly what plain decoding with the same seed gives."""
    target, draft = pair
    drafter = create_drafter("draft-model", target, draft_model=draft, vocab_mapping=mapping)
    plain = create_drafter("none", target)
    prompt = target.tokenizer.encode("hello world")
    for seed in range(3):
        sampling = SamplingParams(temperature=0.8, top_k=20, seed=seed)
        expected, _ = run(target, plain, prompt, max_new_tokens=20, sampling=sampling)
        tokens, outcome = run(target, drafter, prompt, max_new_tokens=20, sampling=sampling, num_draft_tokens=3)
        assert tokens == expected and outcome.stats.drafted_tokens > 0


@pytest.mark.parametrize("mapping", ["intersection", "text", "ngram"])
def test_a_drafter_that_is_the_target_is_always_right(mapping):
    """Drafting with the target itself through the mapping: every draft token must be accepted, which
    only happens if the context and the drafts are translated exactly."""
    tokenizer = bpe_tokenizer(sorted({c for text in CORPUS for c in text}))
    target = tiny_model(tokenizer, seed=3)
    drafter = create_drafter("draft-model", target, draft_model=target, vocab_mapping=mapping)
    tokens, outcome = run(target, drafter, tokenizer.encode("hello world"), max_new_tokens=30, num_draft_tokens=4)
    assert tokens == hf_greedy(target, tokenizer.encode("hello world"), 30)
    assert outcome.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("mapping", ["intersection", "text", "ngram"])
def test_the_drafters_prompt_prefill_is_reported_as_setup(pair, mapping):
    """What the drafter spends catching up with the context is Draft.setup_s, which the draft-length policy
    keeps out of the per-token cost (a cold first request otherwise all but stopped drafting)."""
    from specdecode.drafters.base import DraftRequest

    target, draft = pair
    drafter = create_drafter("draft-model", target, draft_model=draft, vocab_mapping=mapping)
    prompt = target.tokenizer("hello world again and again, hello world again", add_special_tokens=False)["input_ids"]
    session = drafter.session(DraftRequest(prompt_ids=tuple(prompt)))
    first = session.propose(list(prompt), 3)
    assert first.setup_s > 0


def test_bad_mapping_and_combinations_are_refused(pair):
    target, draft = pair
    with pytest.raises(SpecDecodeError, match="vocab_mapping must be one of intersection, text, ngram"):
        create_drafter("draft-model", target, draft_model=draft, vocab_mapping="ngrams")
    with pytest.raises(SpecDecodeError, match="does not combine"):
        create_drafter("draft-model", target, draft_model=draft, vocab_mapping="text", draft_vocab=64)
    assert create_drafter("draft-model", target, draft_model=draft).cross.mapping == "text"  # the default
    with pytest.raises(SpecDecodeError, match="draft_vocab needs a draft model with the target's vocabulary"):
        create_drafter("draft-model", target, draft_model=draft, draft_vocab=64)
    with pytest.raises(VocabularyMismatchError):  # hsd: the draft model verifies its own guesses, in its ids
        create_drafter("hsd", target, draft_model=draft)


# -- exact sampling: bigram toys with different vocabularies ------------------------------------------

TARGET_PIECES = ["a", "b", "c", "d", "e"]  # V tokens
DRAFT_PIECES = ["e", "ab", "c", "x", "a", "b"]  # "d" missing, "ab" and "x" not the target's


def bigram_pair() -> tuple[LoadedModel, LoadedModel, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    target_table = 2.0 * torch.randn(V, V, generator=g)
    draft_lm = BigramLM(2.0 * torch.randn(6, 6, generator=g))
    draft_lm.vocab_size = 6
    target = LoadedModel("bigram-target", BigramLM(target_table), bpe_tokenizer(TARGET_PIECES))
    draft = LoadedModel("bigram-draft", draft_lm, bpe_tokenizer(DRAFT_PIECES, [("a", "b")]))
    return target, draft, target_table


def intersection_counts(tokens_wanted: int) -> tuple[np.ndarray, np.ndarray]:
    target, draft, table = bigram_pair()
    drafter = create_drafter("draft-model", target, draft_model=draft, vocab_mapping="intersection")
    counts = np.zeros((4, V, V))
    produced, seed = 0, 0
    while produced < tokens_wanted:
        sampling = SamplingParams(0.9, 4, seed=seed, coupled=False)  # coupling would bypass rejection sampling
        config = GenerationConfig(max_new_tokens=200, num_draft_tokens=3, sampling=sampling)
        previous = 1  # the prompt's last token
        for chunk in speculative_decode(target.backend, drafter, [0, 1], config):
            for position, token in enumerate(chunk):
                counts[position, previous, token] += 1
                previous = token
            produced += len(chunk)
        seed += 1
    return counts, sampling_probs(table, SamplingParams(0.9, 4)).numpy()


def test_intersection_sampling_is_exact():
    counts, expected = intersection_counts(DRAWS // 2)
    pvalues = chain_pvalues(counts, expected)
    assert len(pvalues) >= 6 and min(pvalues) > PASS_P / len(pvalues), pvalues
    assert counts[1:].sum() > 0  # drafts were accepted


def test_intersection_without_renormalising_fails_the_same_test(monkeypatch):
    """The bug the test is for: sampling inside the intersection but reporting the drafter's mass there
    without renormalising it (as if the tokens outside still took their share)."""
    real = specdecode.drafters.cross_vocab.sampling_probs
    monkeypatch.setattr(specdecode.drafters.cross_vocab, "sampling_probs", lambda logits, s: 0.6 * real(logits, s))
    counts, expected = intersection_counts(DRAWS // 2)
    assert min(chain_pvalues(counts, expected)) < FAIL_P


# -- command line -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mapping", ["intersection", "text", "ngram"])
def test_cli_drafts_across_vocabularies(capsys, tiny_dirs, mapping):
    from specdecode.cli import main

    dirs = [str(tiny_dirs["target"]), str(tiny_dirs["other-vocab"])]
    argv = ["generate", "w1 w2 user", "--model", dirs[0], "--drafter", "draft-model", "--draft-model", dirs[1]]
    assert main([*argv, "--drafter-option", f"vocab_mapping={mapping}", "--json", "--max-new-tokens", "6"]) == 0
    assert '"token_ids"' in capsys.readouterr().out
    assert_one_line_error(capsys, [*argv, "--drafter-option", "vocab_mapping=bytes"], "vocab_mapping must be one of")
    assert main([*argv, "--json", "--max-new-tokens", "6"]) == 0  # another vocabulary: the text mapping by default
    assert '"token_ids"' in capsys.readouterr().out


def test_cli_does_not_refuse_registered_models_with_a_mapping(capsys, monkeypatch):
    """The registry's vocabulary sizes refuse gemma3-270m for smollm2-135m before any download — unless a
    mapping is asked for: then the models load (here: the first load stops the run)."""
    from specdecode.models import loading

    def stop(name, **kwargs):
        raise SpecDecodeError(f"would load {name}")

    monkeypatch.setattr(loading, "load_model", stop)
    argv = ["generate", "hi", "--model", "smollm2-135m", "--drafter", "draft-model", "--draft-model", "gemma3-270m"]
    assert_one_line_error(capsys, [*argv, "--drafter-option", "vocab_mapping=text"], "would load smollm2-135m")
    assert_one_line_error(capsys, argv, "would load smollm2-135m")  # the default mapping: text
    hsd = ["generate", "hi", "--model", "smollm2-135m", "--drafter", "hsd", "--draft-model", "gemma3-270m"]
    assert_one_line_error(capsys, hsd, "vocabulary mismatch")


# -- a real pair ----------------------------------------------------------------------------------------

HELD_OUT = ["Once upon a time, there was a little girl who", "import numpy as np\n\ndef mean(values):\n    return"]


@pytest.mark.real_model
def test_smollm2_drafts_for_gemma3_greedy_identical(smollm2):
    """SmolLM2-135M (byte-level BPE, 49,152 tokens) drafting for Gemma-3-270M (SentencePiece with byte
    fallback, 262,144): the cheapest real pair of two tokenizer families.  Every mapping gives plain
    decoding's tokens; the intersection's drafts are accepted at times."""
    from specdecode.generator import SpeculativeGenerator
    from specdecode.models.loading import load_model

    target, draft = load_model("gemma3-270m"), smollm2
    plain = SpeculativeGenerator.build(target, "none")
    expected = [plain.generate(p, chat=False, max_new_tokens=16, ignore_eos=True).token_ids for p in HELD_OUT]
    for mapping in ("intersection", "text", "ngram"):
        generator = SpeculativeGenerator.build(target, "draft-model", draft_model=draft, vocab_mapping=mapping)
        accepted = 0
        for prompt, tokens in zip(HELD_OUT, expected, strict=True):
            result = generator.generate(prompt, chat=False, max_new_tokens=16, ignore_eos=True, num_draft_tokens=4)
            assert result.token_ids == tokens, mapping
            assert result.stats.drafted_tokens > 0
            accepted += result.stats.accepted_tokens
        assert accepted > 0 or mapping != "intersection", mapping


def test_no_draft_beyond_the_drafters_context():
    from helpers import session_for

    target, draft, _ = bigram_pair()
    draft.backend.max_context = 5
    for mapping in ("intersection", "text", "ngram"):
        drafter = create_drafter("draft-model", target, draft_model=draft, vocab_mapping=mapping)
        session = session_for(drafter, [0, 1])
        assert 0 < len(session.propose([2, 2, 2], 8).tokens) <= 2  # "ccc": 3 drafter tokens, room for 2
        assert session.propose([2] * 8, 8).tokens == []
        assert len(session.propose([2, 2, 2], 8).tokens) <= 2  # and back: the cache was left consistent


def test_auto_expects_less_acceptance_across_vocabularies(pair):
    """A cold request's first drafts and the reading of its prompt are weighed at the acceptance measured across
    vocabularies (about a third), not the policy's default of one half kept for a draft of the same vocabulary."""
    from specdecode.drafters.cross_vocab import PRIOR_ACCEPTANCE
    from specdecode.generator import SpeculativeGenerator

    target, draft = pair
    across = SpeculativeGenerator.build(target, "draft-model", draft_model=draft)
    same = SpeculativeGenerator.build(target, "draft-model", draft_model=target)
    assert across.drafter.prior_acceptance == PRIOR_ACCEPTANCE < 0.5
    assert across.draft_length_policy("auto").prior_acceptance == PRIOR_ACCEPTANCE
    assert same.draft_length_policy("auto").prior_acceptance == 0.5
