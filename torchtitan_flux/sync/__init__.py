"""Weight sync, the trainer side: snapshot, memory ledger, link table, pusher, sparse diffs, the syncer front and
the post-sync probe (the wire format and CUDA/NCCL rules are in ``wire/``)."""
