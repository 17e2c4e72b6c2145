"""The context-parallel strategies: ring, all-gather, Ulysses, hybrid (docs/strategies.md)."""
