"""specdecode's drafters inside other serving engines (vLLM's custom proposer: :mod:`.vllm_proposer`)."""
