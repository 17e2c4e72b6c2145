"""Inference over a KV cache sharded over the ranks: the cache (`kv_cache`) and the prefill and
decode attention over it (`attention`). docs/inference.md."""
