"""The wire between trainer and engines: the push format (buckets, header, sparse patches), the rendezvous and the
engine-side receiver (``transport``), and every CUDA/NCCL rule both sides follow (``cuda_rules``). Imported by
``sync/`` (the trainer side) and ``engine/`` (the engines, in environments without torchtitan): torch only."""
