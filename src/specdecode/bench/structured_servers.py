"""Other OpenAI-compatible servers in ``specdecode bench structured`` (``--url LABEL=URL``: vLLM's CPU build, with
its n-gram speculation or without, our own ``specdecode serve``): each prompt sent as one chat request, greedy,
under its schema as OpenAI's ``response_format`` (``json_schema``, strict) and without, timed from send to the whole
answer.

A server's prefix cache is emptied before each request (``POST /reset_prefix_cache``: vLLM's with
``VLLM_SERVER_DEV_MODE=1``, ours), so that no request reads a prompt another contestant's request left cached: every
contestant reads every prompt.  Its speculation counters (vLLM's names) give its mean acceptance length where it
reports them.
"""

from __future__ import annotations

import time
from typing import Any

from specdecode.bench.serve import acceptance_over, speculation_counters
from specdecode.bench.serve_client import client_for, metrics_text, one_line, reset_prefix_cache
from specdecode.data.structured import StructuredPrompt
from specdecode.errors import SpecDecodeError


def response_format(prompt: StructuredPrompt) -> dict[str, Any]:
    """OpenAI's ``response_format`` holding an answer to ``prompt``'s schema."""
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": prompt.schema, "strict": True}}


class StructuredServer:
    """One server under test: its label, URL and the model name it serves."""

    def __init__(self, label: str, url: str, model: str) -> None:
        self.label, self.url, self.model = label, url, model
        self.client = client_for(url)

    def check(self) -> None:
        """Refuse a server that does not answer, or does not serve ``model``, before anything is measured."""
        try:
            served = [entry.id for entry in self.client.models.list().data]
        except Exception as exc:  # any failure to reach it: one line, no traceback
            raise SpecDecodeError(f"--url {self.label}={self.url} does not answer: {one_line(exc)}") from exc
        if self.model not in served:
            raise SpecDecodeError(
                f"--url {self.label} serves {', '.join(served) or 'no model'}, not {self.model!r} (--served-model)"
            )

    def ask(self, prompt: StructuredPrompt, text: str, constrained: bool, max_tokens: int) -> dict[str, Any]:
        """One greedy chat request for ``text`` → its record: the answer, its length and time, and the server's
        mean acceptance length over it (None where it reports no speculation)."""
        cache_reset = reset_prefix_cache(self.url)
        before = speculation_counters(metrics_text(self.url))
        extra = {"response_format": response_format(prompt)} if constrained else {}
        sent = time.perf_counter()
        reply = self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=0,
            **extra,
        )
        wall_s = time.perf_counter() - sent
        after = speculation_counters(metrics_text(self.url))
        return {
            "prompt": f"{prompt.suite}/{prompt.id}",
            "text": reply.choices[0].message.content or "",
            "new_tokens": reply.usage.completion_tokens,
            "wall_s": round(wall_s, 5),
            "finish_reason": reply.choices[0].finish_reason,
            "mean_acceptance_length": acceptance_over(before, after),
            "prefix_cache_reset": cache_reset,
        }
