"""Trainer-side weight sync: snapshot, push, link table, sparse patches; the post-sync probe. The wire format and
the CUDA/NCCL rules both ends share are in ``wire/``."""
