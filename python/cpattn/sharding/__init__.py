"""Which tokens each rank holds: sequences in a layout (`sequences`: shard, unshard, positions),
packed documents as a batch carries them (`packing`), and document plans (`documents`:
shard_documents, DocumentPlan)."""
