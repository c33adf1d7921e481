"""Weight sync: snapshot, push, transport and the CUDA/NCCL rules; the post-sync probe. (Engines import
``transport`` from here in environments without torchtitan: keep this file empty.)"""
