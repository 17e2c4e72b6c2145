"""Hybrid models under context parallelism: the token mixers outside attention (short
convolutions, Mamba, Mamba-2, the gated delta rule, Kimi delta attention, lightning attention) made
exact on cpattn's shards, per model instance (docs/hybrid-models.md).

- `registry.py`: the adapters by class (`@adapts`, `adapter_of`);
- `adapters.py`: each mixer's forward on this rank's pieces (cpattn.mixers' primitives);
- `forward.py`: a parallelized mixer's call: its checks, agreed over the ranks, and its adapter;
- `documents.py`: how shard_batch's documents reach the mixers, also in checkpoint recomputes;
- `probe.py`: the checks before parallelizing (each adapter against its module, forward and
  backward; the structural refusal of any other token mixing);
- `parallelize.py`: `parallelize` and its handle (public through
  cpattn.integrations.transformers).
"""
