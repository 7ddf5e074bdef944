"""Hydra++'s prefix attention: one attention layer over the target's final hidden states before the heads read them.

Ankner et al. ("Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding", 2024) add to the heads of their
Hydra++ recipe one more attention layer over the base model's final hidden states of the context: the last state is
shaped to predict the next token only, while the heads guess further ahead and gain from the states before it.

Here the layer attends over the last ``window`` positions only, queries and keys rotated by their position
(Llama's rotary embedding), so the window slides without moving any key: a session keeps at most ``window - 1``
keys whatever the context's length (a draft with bounded memory, as LongSpec argues for long contexts), and
training, which attends over the same window, sees exactly what drafting sees.  The output projection starts at
zero, so an untrained layer hands the hidden state over unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.base import apply_rotary

ROPE_THETA = 10_000.0  # positions never exceed the window, so Llama's original base serves any target


class PrefixAttention(nn.Module):
    """``h + W_o Attn(RMSNorm(h))`` over the last ``window`` positions (the position itself included)."""

    def __init__(self, hidden_size: int, num_heads: int, window: int) -> None:
        super().__init__()
        if window < 1 or num_heads < 1 or hidden_size % num_heads or (hidden_size // num_heads) % 2:
            raise ValueError(f"prefix attention: window {window}, {num_heads} heads of a {hidden_size}-wide state")
        self.num_heads, self.window = num_heads, window
        self.norm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.out = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.out.weight)

    def project(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[n, H] states at ``positions`` [n] → rotated queries, rotated keys and values, each [heads, n, d]."""
        q, k, v = (
            part.unflatten(-1, (self.num_heads, -1)).transpose(0, 1)
            for part in self.qkv(self.norm(hidden)).chunk(3, -1)
        )
        dim = q.shape[-1]
        inv_freq = ROPE_THETA ** (-torch.arange(0, dim, 2, device=hidden.device, dtype=torch.float32) / dim)
        angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(
        self, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The layer's output [n, H] for the states ``hidden`` [n, H] whose queries are ``q``, given keys and values
        [heads, m, d] and ``mask`` [n, m] (True: may attend; every row has its own position at least)."""
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return hidden + self.out(attended.transpose(0, 1).flatten(-2))

    def in_window(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """[n, m]: which keys each query reads — its own position and the ``window - 1`` before it."""
        behind = query_positions.unsqueeze(-1) - key_positions
        return (behind >= 0) & (behind < self.window)


class PrefixWindow:
    """One session's keys and values of its last ``window - 1`` positions: the states of new positions go through the
    layer against them, in slices of at most ``window`` rows (a prompt's mask stays small)."""

    def __init__(self, layer: PrefixAttention) -> None:
        self.layer = layer
        self.keys: torch.Tensor | None = None  # [heads, m, d]: those of the m positions before ``next``
        self.values: torch.Tensor | None = None
        self.next = 0  # the position of the next state given

    def extend(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's outputs [n, H] for the next ``n`` positions' final hidden states ``hidden`` [n, H]."""
        outputs = [self._slice(part) for part in hidden.split(self.layer.window)]
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _slice(self, hidden: torch.Tensor) -> torch.Tensor:
        end = self.next + hidden.shape[0]
        positions = torch.arange(self.next, end, device=hidden.device)
        q, k, v = self.layer.project(hidden, positions)
        if self.keys is not None:
            k, v = torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)
        key_positions = torch.arange(end - k.shape[1], end, device=hidden.device)
        out = self.layer.attend(hidden, q, k, v, self.layer.in_window(positions, key_positions))
        first = max(0, k.shape[1] - (self.layer.window - 1))  # the keys later positions may still read
        self.keys, self.values, self.next = k[:, first:], v[:, first:], end
        return out
