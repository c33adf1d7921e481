"""CUDA graphs of the continuous batcher's decode step (``rollout.decode_graphs``): the only GPU-only code of it.
Everything else (buckets, static buffers, padded rows, the weight copy at a swap, sampling) is
``engine/decoding.GraphDecode``, which CPU tests run as its eager twin. docs/gpu.md's rules 10-16 say what this
follows, and what only a GPU run confirms (unmeasured so far).

A bucket's first step runs the step eagerly on a side stream (that run is the step, and the warm-up: lazy
initialisations such as cuBLAS's workspace for that stream happen there, outside any capture), then captures it
on the same stream into a graph of this engine's one private memory pool (``capture_error_mode="thread_local"``:
the receiver thread's own CUDA calls, its copies of staging on its stream, stay legal during a capture). Later
steps of the bucket replay the graph on the engine's stream. Colocated engines only (rule 16): ``capture_begin``
itself waits, without a deadline, for every NCCL work pending in the process, and an engine receiving over NCCL
always has its next header's receive pending. Graphs share the pool: they replay one at a time on
one stream, never concurrently, and every tensor a graph reads or writes between steps is allocated outside it.

Capture calls ``CUDAGraph.capture_begin``/``capture_end`` itself, not the ``torch.cuda.graph`` context: that one
synchronises the whole device and empties the allocator's cache first, which would wait on whatever the receiver
thread has queued. Nothing here synchronises; the batcher's one read a step is the only wait.

Threads: the engine's main thread only.
"""

from __future__ import annotations

from typing import Callable

import torch


class CapturedSteps:
    """Decode-step graphs by bucket key, captured at first use."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()  # one private pool for every graph of this engine
        # warm-ups and captures: never the engine's own stream, nor one a receiver or NCCL draws (rule 16): those come
        # from the normal-priority pool, which hands its 32 streams out round-robin, so a receiver restarted often
        # would share one with a normal-priority capture stream; this one is from the high-priority pool
        self.stream = torch.cuda.Stream(device, priority=-1)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}

    def run(self, key: tuple, step: Callable[[], None]) -> None:
        """``step`` once: replayed if ``key``'s graph exists, else run eagerly on the side stream, then captured."""
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()  # on the current stream, after the work queued before it
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the step reads what the engine's stream wrote (joins, moves, copies)
        with torch.cuda.stream(self.stream):
            step()  # this step's run, and the bucket's warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                step()  # recorded, not run
            finally:
                graph.capture_end()
        current.wait_stream(self.stream)  # the batcher's read and next writes come after the step
        self.graphs[key] = graph
