"""``specdecode serve``: an OpenAI-compatible HTTP server over the batched speculative engine."""
