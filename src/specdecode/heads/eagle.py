"""The EAGLE-3 draft head: one decoder layer that drafts from the target's own features.

After Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
Test" (and EAGLE / EAGLE-2 before it).  The target's hidden states entering three of its layers (low,
middle, high: ``aux_layers``) are concatenated and projected to one feature by ``fc``.  The head's
decoder layer reads, per position, that feature and the embedding of the *next* token (each through its
own norm, side by side: 2H inputs to q/k/v), attends over the head's own cache of earlier positions,
and its output goes through ``norm`` and a small ``lm_head`` over the draft vocabulary (VocabTrim: the
ids the target emits most often; ``d2t`` maps them back).  Drafting deeper feeds the layer's *output*
back in place of a target feature — which is why it is trained with training-time test
(:mod:`specdecode.train.eagle`), on its own outputs.

Module and buffer names are those of vLLM's ``speculators`` EAGLE-3 format (``fc``, ``layers.0.*``,
``norm``, ``lm_head``, ``d2t`` as offsets, ``t2d`` as a mask), so saving is writing the state dict
(:mod:`specdecode.heads.storage`).  Positions: the pair (feature of token j, token j+1) sits at position
j+1, as in ``speculators``' training data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.base import DecoderShape, apply_rotary


@dataclass(frozen=True)
class EagleConfig:
    """Everything needed to build an :class:`EagleHead` (saved with it)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    target_vocab_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    target_num_layers: int

    @classmethod
    def for_target(
        cls, shape: DecoderShape, num_layers: int, target_vocab_size: int, draft_vocab_size: int
    ) -> EagleConfig:
        """A head shaped like one of the target's layers, fusing EAGLE-3's default layers
        (2, L/2, L-3 — vLLM's and ``speculators``' choice)."""
        return cls(
            hidden_size=shape.hidden_size,
            num_heads=shape.num_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            intermediate_size=shape.intermediate_size,
            rms_norm_eps=shape.rms_norm_eps,
            rope_theta=shape.rope_theta,
            target_vocab_size=target_vocab_size,
            draft_vocab_size=min(draft_vocab_size, target_vocab_size),
            aux_layers=default_aux_layers(num_layers),
            target_num_layers=num_layers,
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "aux_layers": list(self.aux_layers)}

    @classmethod
    def from_dict(cls, data: dict) -> EagleConfig:
        return cls(**{**data, "aux_layers": tuple(data["aux_layers"])})


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


class EagleAttention(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        inner, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(2 * config.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(2 * config.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(2 * config.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=False)


class EagleMLP(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    """A Llama decoder layer whose attention reads [norm(embedding), norm(feature)].

    Split in two around attention (:meth:`project`, :meth:`finish`) so that drafting (a KV cache and a
    tree mask) and training (training-time test's diagonal attention) each do attention their own way
    with the same weights."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = EagleAttention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = EagleMLP(config)

    def project(
        self, hidden: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., n, H] features and embeddings → rotated q [..., heads, n, d], k and v [..., kv_heads, n, d]."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        c = self.config
        attn = self.self_attn
        q = _heads(attn.q_proj(x), c.num_heads, c.head_dim)
        k = _heads(attn.k_proj(x), c.num_kv_heads, c.head_dim)
        v = _heads(attn.v_proj(x), c.num_kv_heads, c.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual over the feature, attention output [..., heads, n, d] projected back, then the MLP."""
        merged = attended.transpose(-2, -3).flatten(-2)
        hidden = hidden + self.self_attn.o_proj(merged)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _heads(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, dim)).transpose(-2, -3)


class HeadCache:
    """The head's keys and values of one sequence: [kv_heads, length, head_dim], grown in blocks.

    The first ``committed`` entries hold the context; those after it, a draft's guesses until the next :meth:`crop`.
    With a ``window`` the context's entries stay bounded, as LongSpec bounds its draft model's cache: at each
    :meth:`commit` beyond ``SINKS + window + BLOCK`` entries, all but the first :data:`SINKS` (attention sinks, as
    StreamingLLM keeps them) and the last ``window`` are dropped, so the head attends to those plus at most one block
    more, whatever the context's length.  Keys carry their rotary positions, so dropping entries moves none."""

    BLOCK = 256
    SINKS = 4

    def __init__(self, config: EagleConfig, device: torch.device, dtype: torch.dtype, window: int = 0) -> None:
        self.shape = (config.num_kv_heads, 0, config.head_dim)
        self.keys = torch.empty(self.shape, device=device, dtype=dtype)
        self.values = torch.empty(self.shape, device=device, dtype=dtype)
        self.length = 0
        self.committed = 0
        self.window = window

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add [kv_heads, n, d] entries; everything held, as views."""
        end = self.length + keys.shape[1]
        if end > self.keys.shape[1]:
            grown = (self.shape[0], -(-end // self.BLOCK) * self.BLOCK, self.shape[2])
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_empty(grown)
                new[:, : self.length] = old[:, : self.length]
                setattr(self, name, new)
        self.keys[:, self.length : end] = keys
        self.values[:, self.length : end] = values
        self.length = end
        return self.keys[:, :end], self.values[:, :end]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def unread(self, new: int) -> tuple[int, int]:
        """Of ``new`` context entries about to be appended and committed, the span [start, end) that commit would drop
        at once (a window's middle; (0, 0): none).  A one-layer head's keys and values of a row depend on that row
        alone, so those rows need not be computed: appending the others and committing with ``compact`` leaves the
        very entries appending them all would (a long prompt then costs the head its sinks and its window, not its
        length)."""
        if not self.window or self.length + new <= self.SINKS + self.window + self.BLOCK:
            return 0, 0
        start, end = max(0, self.SINKS - self.length), new - self.window
        return (start, end) if end > start else (0, 0)

    def commit(self, compact: bool = False) -> None:
        """Every entry held is the context's; with a window, drop the oldest beyond it (a block at a time, so copying
        stays rare; every time with ``compact``, after appending past an :meth:`unread` span)."""
        limit = self.SINKS + self.window + (0 if compact else self.BLOCK)
        if self.window and self.length > limit:
            recent = slice(self.length - self.window, self.length)
            for cached in (self.keys, self.values):
                cached[:, self.SINKS : self.SINKS + self.window] = cached[:, recent].clone()
            self.length = self.SINKS + self.window
        self.committed = self.length


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.aux_layers) * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([EagleLayer(config)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        identity = torch.arange(config.draft_vocab_size)
        # speculators' vocabulary maps: target id of draft id i is i + d2t[i]; t2d marks drafted target ids.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.target_vocab_size, dtype=torch.bool))
        self.set_draft_vocabulary(identity)
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def layer(self) -> EagleLayer:
        return self.layers[0]

    def set_draft_vocabulary(self, target_ids: torch.Tensor) -> None:
        """The target ids the head drafts, ascending, one per ``lm_head`` row."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).sort().values
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"draft vocabulary needs {self.config.draft_vocab_size} ids, got {ids.numel()}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of each draft id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [..., n, head_dim] for positions [..., n] (Llama's rotate-half layout)."""
        angles = positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        dtype = self.fc.weight.dtype
        return angles.cos().to(dtype).unsqueeze(-3), angles.sin().to(dtype).unsqueeze(-3)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated layer features [..., n, k*H] → the head's input feature [..., n, H]."""
        return self.fc(features)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the layer's outputs."""
        return self.lm_head(self.norm(hidden)).float()

    def extend(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: HeadCache,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run n new positions ([n, H] features and next-token embeddings) on top of ``cache`` (which they
        are appended to) and return the layer's outputs [n, H].

        mask: [n, cache.length + n] bool, what each new position may attend to, cache entries included (a
        draft tree's node sees the context and its ancestors only); default: the whole cache, and the new
        positions causally."""
        cos, sin = self.rope(positions)
        q, k, v = self.layer.project(hidden, embeds, cos, sin)
        past = cache.length
        keys, values = cache.append(k, v)
        n = hidden.shape[0]
        if mask is None and past > 0 and n > 1:
            causal = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()
            mask = torch.cat([torch.ones(n, past, dtype=torch.bool, device=hidden.device), causal], dim=1)
        # With nothing cached, SDPA's own causal path: a prompt's thousands of rows without a mask to read.
        causal_only = mask is None and past == 0 and n > 1
        attended = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=causal_only, enable_gqa=True
        )
        return self.layer.finish(hidden, attended)
