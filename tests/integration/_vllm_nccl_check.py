"""Run by tests/integration/test_vllm.py under .venv-vllm: our staging snapshot as the WeightSource of vLLM's
trainer-side NCCL engine (metadata and iteration agree by vLLM's own check), vLLM's init info (with our packed
buffer size), and the Work-like handle of a push."""
import types, torch
from torchtitan_flux.wire import transport
from torchtitan_flux.engine import vllm_nccl
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine, NCCLTrainerInitInfo
specs = [transport.TensorSpec("a.w", (2, 3), "bfloat16"), transport.TensorSpec("a.b", (3,), "bfloat16"),
         transport.TensorSpec("c.w", (4,), "float32")]
plan = transport.plan_buckets(specs, 16)
staging = plan.allocate("cpu")
for i, f in enumerate(staging.flats):
    f.copy_(torch.arange(f.numel()) + 10 * i)
meta = [([s.name.upper() for s in plan.specs[b.start:b.end]], [s.dtype for s in plan.specs[b.start:b.end]],
         [list(s.shape) for s in plan.specs[b.start:b.end]]) for b in plan.buckets]
running = vllm_nccl._Push(1)
assert running.start()  # the push the source serves: running (an abandoned one stops the producer: unit-tested)
fake = types.SimpleNamespace(_bucket_meta=meta, _plan=plan, _flats=staging.flats, _push=running)
src = vllm_nccl.staging_source(fake, torch.device("cpu"))
pairs = list(NCCLTrainerWeightTransferEngine._checked_iter(src, src.metadata()))
assert [n for n, _ in pairs] == ["A.W", "A.B", "C.W"], pairs
assert torch.equal(pairs[0][1], staging.views["a.w"]) and pairs[2][1].dtype == torch.float32
info = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=1, world_size=2,
                           packed_buffer_size_bytes=plan.nbytes)  # what own_group passes: our bucket size (N8)
assert info.is_sender and info.packed and info.packed_buffer_size_bytes == plan.nbytes
p = vllm_nccl._Push(3)  # the Work-like handle of one self_push
assert not p.is_completed() and p.start()
p.future.set_result(None)
assert p.is_completed() and p.wait() and p.finish() and p.state == "done"
print("ok")
