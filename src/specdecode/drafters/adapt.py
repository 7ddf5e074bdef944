"""Online adaptation of a draft model (``draft-model`` with ``adapt=true``): OSD and OmniDraft on a CPU.

The draft model is fine-tuned on what the target verified, request after request, so that a drafter
serving one domain drafts more of it right.  What is learnt, and where:

* **Weights: LoRA** (``peft``) on every linear layer of the draft model's last :data:`LORA_LAYERS`
  decoder layers, rank :data:`LORA_RANK`.  The base weights are never written: the drafter adapts a
  *copy* of the draft model's module tree that shares every base tensor with the loaded model (so a
  draft model given by the caller, or the target itself, is never changed), and the adapted layers'
  oneDNN-packed linears (the CPU fast path, :mod:`specdecode.models.fastpath`) become plain
  ``nn.Linear`` again under their LoRA wrappers — peft wraps only those, and the packed kernel has no
  gradient.  Every other layer keeps the fast path.
* **Examples**: every finished request leaves one (:mod:`specdecode.drafters.adapt_data`): the
  drafter's tokens of the verified text, with each generated token weighted 1 where the drafter got it
  wrong (OSD's mismatches) and less (``AGREED_WEIGHT``) where its draft was accepted, and the target's
  top probabilities at the mismatches for a distillation term (across vocabularies, only where the
  target's tokens map to the drafter's: OmniDraft's hybrid loss).  A bounded replay buffer keeps the last
  :data:`BUFFER` examples of at most ``WINDOW`` tokens each.
* **Whether it drafts**: before training on a finished request, which it has not seen yet, the adapter
  and the base weights each predict its verified tokens (teacher-forced top-1, two forwards).  The
  adapter drafts only while, over the last :data:`CHECK_WINDOW` requests, it predicted at least as many
  as the base weights; otherwise the base weights draft and the adapter keeps training until it
  catches up.  On open chat (ShareGPT openings about Python, a 1.5B target), LoRA trained on what the
  target wrote predicts the next requests *worse* at every learning rate (it learns those answers, not the
  target): without the check, adaptation there makes drafting worse than no adaptation
  (``docs/results/adapt-sim-smollm2-qwen2.5-coder-1.5b``, ``docs/results/avx2/adapt-sharegpt-python-w4a8``).
* **When**: only at a request's end (``DraftSession.finish``), never during verification; optimizer
  steps run while their time stays within ``adapt_budget`` × the request's decoding time (an overrun or
  an unused share carries over), at most ``adapt_steps`` per request.  A drafting session still open
  when the weights change drops its drafter cache, so its drafts stay a function of the current
  weights and its context.

The drafter's output only affects speed: the target verifies every draft, so adaptation can never
change what is generated.  ``adapt_save=DIR`` writes the adapter (peft's ``adapter_config.json`` and
``adapter_model.safetensors``) after every update; ``adapt_load=DIR`` starts from one (and, without
``adapt=true``, drafts with it frozen).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specdecode.drafters.adapt_data import Example
from specdecode.drafters.base import flag_option
from specdecode.errors import SpecDecodeError
from specdecode.models.fastpath import PackedLinear
from specdecode.models.loading import LoadedModel
from specdecode.models.lora import lora_targets, shared_copy

#: Decoder layers (the last ones) whose linear layers get LoRA.
LORA_LAYERS = 8
LORA_RANK = 16
LORA_ALPHA = 32
LEARNING_RATE = 1e-3
#: Examples (finished requests) in the replay buffer.
BUFFER = 32
#: Requests over which the adapter's predictions of each new request are compared with the base weights'.
CHECK_WINDOW = 5
#: Share of the distillation term (target's top probabilities) at a mismatch, beside the verified token's.
SOFT_SHARE = 0.5
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def asks_to_adapt(options: Mapping[str, Any]) -> bool:
    """Whether drafter options (checked, or as given on a command line) turn online adaptation on; a bad
    ``adapt`` value is the same one-line error as when the drafter is built."""
    value = options.get("adapt")
    return value is not None and flag_option("adapt", value)


def _positive(name: str, value: Any, kind: type) -> Any:
    """``value`` as a positive ``kind`` (int or float; an int may come as digits), or a one-line error."""
    number = None
    if not isinstance(value, bool):
        if kind is int and (isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit())):
            number = int(value)
        elif kind is float:
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = None
    if number is None or not number > 0 or number == float("inf"):
        raise SpecDecodeError(f"{name} must be a positive {'integer' if kind is int else 'number'}, got {value!r}")
    return number


@dataclass(frozen=True)
class AdaptOptions:
    """The ``adapt*`` drafter options, checked.  ``train``: learn online; ``load`` alone drafts frozen."""

    train: bool
    budget: float = 0.1
    steps: int = 8
    learning_rate: float = LEARNING_RATE
    save: Path | None = None
    load: Path | None = None

    @classmethod
    def parse(
        cls,
        adapt: Any = None,
        adapt_budget: Any = None,
        adapt_steps: Any = None,
        adapt_lr: Any = None,
        adapt_save: Any = None,
        adapt_load: Any = None,
    ) -> AdaptOptions | None:
        """None when no adapter is asked for; a one-line error for a bad value or a meaningless combination."""
        train = flag_option("adapt", adapt) if adapt is not None else False
        tuning = {"adapt_budget": adapt_budget, "adapt_steps": adapt_steps, "adapt_lr": adapt_lr}
        given = [name for name, value in {**tuning, "adapt_save": adapt_save}.items() if value is not None]
        if not train and given:
            raise SpecDecodeError(f"{given[0]} needs adapt=true")
        if not train and adapt_load is None:
            return None
        load = Path(str(adapt_load)).expanduser() if adapt_load is not None else None
        if load is not None and not (load / WEIGHTS_FILE).is_file():
            raise SpecDecodeError(f"adapt_load: {str(load)!r} holds no adapter ({WEIGHTS_FILE})")
        defaults = cls(train)
        return cls(
            train=train,
            budget=_positive("adapt_budget", adapt_budget, float) if adapt_budget is not None else defaults.budget,
            steps=_positive("adapt_steps", adapt_steps, int) if adapt_steps is not None else defaults.steps,
            learning_rate=_positive("adapt_lr", adapt_lr, float) if adapt_lr is not None else defaults.learning_rate,
            save=Path(str(adapt_save)).expanduser() if adapt_save is not None else None,
            load=load,
        )


class OnlineAdapter:
    """The drafter's LoRA adapter, its optimizer and replay buffer: what adaptation shares across requests."""

    def __init__(self, loaded: LoadedModel, options: AdaptOptions) -> None:
        try:  # peft is optional (the adapt extra): needed only where a drafter adapts
            from peft import LoraConfig, inject_adapter_in_model
            from peft.tuners.tuners_utils import BaseTunerLayer
        except ImportError as exc:
            raise SpecDecodeError('adapt needs the peft package: pip install "specdecode[adapt]"') from exc

        self.options = options
        self.draft = shared_copy(loaded)
        model = self.draft.backend.model
        if options.load is not None:
            config = LoraConfig.from_pretrained(str(options.load))
            for name in config.target_modules:  # the layers it names become plain nn.Linear
                try:
                    module = model.get_submodule(name)
                except AttributeError as exc:
                    raise SpecDecodeError(f"adapt_load: {str(options.load)!r} does not fit this draft model") from exc
                if isinstance(module, PackedLinear):
                    model.set_submodule(name, module.to_linear())
        else:
            targets = lora_targets(model, self.draft.backend.num_layers, LORA_LAYERS)
            config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets)
            config.base_model_name_or_path = loaded.name
        self.config = config
        inject_adapter_in_model(config, model)
        self._tuned = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
        self.lora = [p for name, p in model.named_parameters() if "lora_" in name]
        self._initial = [p.detach().clone() for p in self.lora]
        if options.load is not None:
            self._load(options.load)
        for p in self.lora:
            p.requires_grad_(options.train)
        self.buffer: deque[Example] = deque(maxlen=BUFFER)
        self.optimizer = torch.optim.AdamW(self.lora, lr=options.learning_rate) if options.train else None
        self.credit_s = 0.0
        self.version = 0  # bumped by every update: open sessions then drop their drafter caches
        # Per checked request: the adapter's share of its tokens predicted right minus the base weights'.
        self.checks: deque[float] = deque(maxlen=CHECK_WINDOW)
        self.drafting = True  # the adapter drafts (else the base weights)
        self.steps = 0
        self.train_s = 0.0  # time spent training, all told (benchmarks report it)
        self._rng = torch.Generator().manual_seed(0)

    def reset(self) -> None:
        """Forget everything learnt (back to the initial or loaded adapter)."""
        with torch.no_grad():
            for p, initial in zip(self.lora, self._initial):
                p.copy_(initial)
        self.buffer.clear()
        self.checks.clear()
        self._use_adapter(True)
        self.drafting = True
        if self.optimizer is not None:
            self.optimizer = torch.optim.AdamW(self.lora, lr=self.options.learning_rate)
        self.credit_s, self.steps, self._rng = 0.0, 0, torch.Generator().manual_seed(0)
        self.version += 1

    def learn(self, example: Example | None, decoding_s: float) -> None:
        """A request is over: keep its example and train within the budget its decoding time earned."""
        if not self.options.train:
            return
        self.credit_s += self.options.budget * decoding_s
        was_drafting, done = self.drafting, 0
        if example is not None and example.rows.numel():
            if self.credit_s > 0:  # the check is adaptation's cost too: in debt, nothing runs
                self._timed(self._check, example)
            self.buffer.append(example)
        self._use_adapter(True)
        while self.buffer and self.credit_s > 0 and done < self.options.steps:
            self._timed(self._step, self.buffer[-1] if done == 0 else self._replayed())
            done += 1
        self._use_adapter(self.drafting)
        if done or self.drafting != was_drafting:
            self.version += 1
        if done and self.options.save is not None:
            self.save(self.options.save)

    def _timed(self, work: Callable[[Example], None], example: Example) -> None:
        """``work(example)``, its time charged to the training budget."""
        started = time.perf_counter()
        work(example)
        spent = time.perf_counter() - started
        self.credit_s -= spent
        self.train_s += spent

    def _use_adapter(self, on: bool) -> None:
        """Whether the model's forward adds the LoRA terms (peft's switch; it also clears their gradient
        flag, restored here)."""
        for module in self._tuned:
            module.enable_adapters(on)
        for p in self.lora:
            p.requires_grad_(self.options.train)

    def _check(self, example: Example) -> None:
        """A prequential check: on a request it has not trained on, does the adapter predict the verified
        tokens at least as well as the base weights?  Decides who drafts the next requests."""
        model = self.draft.backend.model
        labels = example.ids[example.rows + 1]
        right = []
        for on in (True, False):
            self._use_adapter(on)
            with torch.no_grad():
                logits = model(input_ids=example.ids[None], use_cache=False, logits_to_keep=example.rows).logits[0]
            right.append(float((logits.argmax(-1) == labels).float().mean()))
        self.checks.append(right[0] - right[1])
        self.drafting = sum(self.checks) >= 0

    def _replayed(self) -> Example:
        return self.buffer[int(torch.randint(len(self.buffer), (1,), generator=self._rng))]

    def _step(self, example: Example) -> None:
        """One optimizer step on one example: the verified token's cross-entropy, mixed at the mismatches
        with the target's top probabilities (soft cross-entropy), weighted per token."""
        model = self.draft.backend.model
        rows = example.rows
        with torch.enable_grad():
            logits = model(input_ids=example.ids[None], use_cache=False, logits_to_keep=rows).logits[0]
            logp = logits.float().log_softmax(-1)
            loss = -logp.gather(1, example.ids[rows + 1, None])[:, 0]
            if example.soft_rows.numel():
                soft = -(example.soft_probs * logp[example.soft_rows].gather(1, example.soft_ids)).sum(-1)
                loss = loss.index_add(0, example.soft_rows, SOFT_SHARE * (soft - loss[example.soft_rows]))
            loss = (example.weights * loss).sum() / example.weights.sum()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        self.optimizer.step()
        self.steps += 1

    def buffer_tokens(self) -> int:
        return sum(int(example.ids.numel()) for example in self.buffer)

    def save(self, directory: Path) -> None:
        """peft's adapter layout, written to a temporary name first so a reader never sees half a file."""
        from peft import get_peft_model_state_dict  # optional: present, since this adapter was built with it

        directory.mkdir(parents=True, exist_ok=True)
        # save_embedding_layers=False: "auto" looks the base model up on the hub (retries without a network).
        model = self.draft.backend.model
        state = get_peft_model_state_dict(model, save_embedding_layers=False)
        state = {k: v.detach().contiguous() for k, v in state.items()}
        partial = directory / f"{WEIGHTS_FILE}.partial"
        save_file(state, str(partial))
        self.config.save_pretrained(str(directory))
        partial.replace(directory / WEIGHTS_FILE)

    def _load(self, directory: Path) -> None:
        from peft import set_peft_model_state_dict  # optional: present, since this adapter was built with it

        try:
            result = set_peft_model_state_dict(self.draft.backend.model, load_file(str(directory / WEIGHTS_FILE)))
        except (RuntimeError, ValueError) as exc:
            raise SpecDecodeError(f"adapt_load: {str(directory)!r} does not fit this draft model") from exc
        if result.unexpected_keys:
            raise SpecDecodeError(f"adapt_load: {str(directory)!r} does not fit this draft model")
        self._initial = [p.detach().clone() for p in self.lora]
