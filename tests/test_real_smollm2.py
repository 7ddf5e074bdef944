"""Lossless greedy decoding on the real bundled default model (SmolLM2-135M-Instruct, fp32)."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_tree_nodes_get_their_branch_fed_alone, untrained_drafter_options
from specdecode.drafters import available_drafters, drafter_class
from specdecode.generator import SpeculativeGenerator

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Repeat this list exactly, then add two more fruits: apple, banana, cherry, date, elderberry, fig.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\nRewrite this function iteratively, keeping the docstring.",
]
NEW_TOKENS = 40
DRAFTER_TOKENS = 32  # per drafter, two prompts each
GROUNDED_PROMPT = (
    "Here is a config file:\n\nserver:\n  host: 0.0.0.0\n  port: 8080\n  workers: 4\n"
    "logging:\n  level: info\n  file: /var/log/app.log\n\n"
    "Change the port to 9090 and print the whole updated file."
)
# Every drafter that works without a second model, a datastore or training (those have tests of their own).
MODEL_FREE = [
    name
    for name in available_drafters()
    if name not in {"none", "draft-model", "hsd", "rasd"} and not drafter_class(name).needs_training
]


def transformers_greedy(loaded, prompt_ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt_ids])
    out = loaded.backend.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=[],
        pad_token_id=loaded.tokenizer.pad_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


def test_greedy_output_identical_to_plain_and_transformers(smollm2):
    plain = SpeculativeGenerator.build(smollm2, "none")
    lookup = SpeculativeGenerator.build(smollm2, "pld")
    for prompt in PROMPTS:
        prompt_ids = plain.encode_prompt(prompt, chat=True)
        expected = transformers_greedy(smollm2, prompt_ids)
        ours_plain = plain.generate(prompt, chat=True, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        ours_pld = lookup.generate(prompt, chat=True, max_new_tokens=NEW_TOKENS, ignore_eos=True, num_draft_tokens=6)
        assert ours_plain.token_ids == expected
        assert ours_pld.token_ids == expected
        assert ours_pld.stats.steps <= ours_plain.stats.steps


def test_draft_model_identical_and_self_draft_accepts_all(smollm2):
    k = 3
    # The full head (no VocabTrim): a token outside the trimmed rows is never drafted, so only then does a
    # model drafting for itself have every draft accepted.
    generator = SpeculativeGenerator.build(smollm2, "draft-model", draft_model=smollm2, draft_vocab=0)
    result = generator.generate(PROMPTS[0], chat=True, max_new_tokens=8 * (k + 1), ignore_eos=True, num_draft_tokens=k)
    prompt_ids = generator.encode_prompt(PROMPTS[0], chat=True)
    assert result.stats.mean_accepted_tokens == k + 1
    assert result.token_ids == transformers_greedy(smollm2, prompt_ids, 8 * (k + 1))


def test_chat_output_stops_at_end_of_turn(smollm2):
    result = SpeculativeGenerator.build(smollm2, "pld").generate("Say hello.", chat=True, max_new_tokens=64)
    assert result.finish_reason == "eos" and result.text.strip()
    assert result.token_ids[-1] == smollm2.tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' greedy continuation of each prompt, computed once for all drafters."""
    done: dict[tuple[int, ...], list[int]] = {}

    def continuation(prompt_ids: list[int]) -> list[int]:
        if tuple(prompt_ids) not in done:
            done[tuple(prompt_ids)] = transformers_greedy(smollm2, prompt_ids, DRAFTER_TOKENS)
        return done[tuple(prompt_ids)]

    return continuation


@pytest.mark.parametrize("name", MODEL_FREE)
def test_every_drafter_is_lossless_on_a_grounded_and_a_chat_prompt(smollm2, reference, name):
    generator = SpeculativeGenerator.build(smollm2, name)
    for prompt in (GROUNDED_PROMPT, PROMPTS[0]):
        expected = reference(generator.encode_prompt(prompt, chat=True))
        result = generator.generate(prompt, chat=True, max_new_tokens=DRAFTER_TOKENS, ignore_eos=True)
        assert result.token_ids == expected, name


BATCH_PROMPTS = [  # long, grounded, short chat; the short one ends (EOS) well before its token limit
    (PROMPTS[2], 16),
    (GROUNDED_PROMPT, 20),
    ("What is 2 + 2? Answer with one number.", 28),
]


def test_every_drafter_gives_each_sequence_of_a_batch_its_solo_greedy_output(smollm2):
    plain = SpeculativeGenerator.build(smollm2, "none")
    solo = [plain.generate(p, chat=True, max_new_tokens=n) for p, n in BATCH_PROMPTS]
    assert any(r.finish_reason == "eos" for r in solo) and any(r.finish_reason == "length" for r in solo)
    options = untrained_drafter_options(smollm2, smollm2, draft_vocab=4096, exit_layer=20)
    for name in available_drafters():
        generator = SpeculativeGenerator.build(smollm2, name, **options.get(name, {}))
        requests = [(p, generator.config_for(max_new_tokens=n)) for p, n in BATCH_PROMPTS]
        batch = generator.run_batch(requests, chat=True, batch_size=8)
        for index, (alone, together) in enumerate(zip(solo, batch)):
            assert together.token_ids == alone.token_ids, f"{name}: sequence {index} differs from its solo output"
            assert together.finish_reason == alone.finish_reason


def test_random_trees_on_reduced_precision_smollm2_give_every_node_its_branch_fed_alone():
    """Batched row-invariant tree attention on a real bf16 model (int8 where the CPU has no bf16 matmul): random
    trees (bushy and chain-like, up to 32 nodes) after prompts of 20-300 tokens, every node's logits bitwise those of
    its branch fed one token at a time (the guard behind greedy equality for every tree drafter on bf16 and quantized
    targets)."""
    import random

    from specdecode.models.loading import load_model
    from specdecode.models.quantize import quantize_supported
    from specdecode.types import Draft

    backend = load_model("smollm2-135m", quantize="bf16" if quantize_supported("bf16") else "int8").backend
    rng = random.Random(0)
    for _ in range(4):
        context = [rng.randrange(1, backend.vocab_size) for _ in range(rng.randint(21, 301))]
        size = rng.randint(2, 32)
        parents = [rng.choice([-1, *range(i)]) if rng.random() < 0.5 else i - 1 for i in range(size)]
        draft = Draft([rng.randrange(1, backend.vocab_size) for _ in range(size)], parents=parents)
        assert_tree_nodes_get_their_branch_fed_alone(backend, context, draft)


def test_the_shipped_eagle_head_drafts_without_training_and_changes_nothing(smollm2, reference):
    """``--drafter eagle`` on a fresh machine: the head shipped in the package is found, its drafts are accepted
    (an untrained head's almost never are) and the output is plain decoding's."""
    from specdecode.heads.files import shipped_head
    from specdecode.heads.storage import HEAD_DIR

    assert shipped_head("smollm2-135m", HEAD_DIR) is not None
    generator = SpeculativeGenerator.build(smollm2, "eagle", tree_nodes=0, lookup=False)
    prompt = PROMPTS[0]
    result = generator.generate(prompt, chat=True, max_new_tokens=DRAFTER_TOKENS, ignore_eos=True, num_draft_tokens=3)
    assert result.token_ids == reference(generator.encode_prompt(prompt, chat=True))
    assert result.stats.accepted_tokens > 0


def test_the_shipped_hydra_heads_draft_without_training_and_change_nothing(smollm2, reference):
    """``--drafter hydra`` on a fresh machine: the heads shipped in the package (bf16 weights, drafting in the
    target's fp32) are named explicitly, since heads trained next to the cached model would win over them."""
    from specdecode.heads.files import shipped_head
    from specdecode.heads.medusa import heads_dir

    shipped = shipped_head("smollm2-135m", heads_dir("hydra"))
    assert shipped is not None
    # A chain of 3 (as for EAGLE above): `auto` would size the draft from timings, and may draft nothing.
    generator = SpeculativeGenerator.build(smollm2, "hydra", heads=str(shipped), tree_nodes=0, lookup=False)
    prompt = PROMPTS[0]
    result = generator.generate(prompt, chat=True, max_new_tokens=DRAFTER_TOKENS, ignore_eos=True, num_draft_tokens=3)
    assert result.token_ids == reference(generator.encode_prompt(prompt, chat=True))
    assert result.stats.accepted_tokens > 0
