"""Tests for ``torchtitan_flux.patches``: the CPU/gloo fixes torchtitan 0.3.0 needs, each shown still needed."""

import json
import os
import socket
import subprocess
import sys
import types
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from torch._utils import _get_available_device_type

from torchtitan_flux import patches

requires_no_accelerator = pytest.mark.skipif(
    _get_available_device_type() is not None,
    reason="the cpu_device patch only applies without an accelerator",
)


@requires_no_accelerator
def test_cpu_device_patch_points_torchtitan_at_cpu():
    applied = patches.apply_patches()
    assert "cpu_device" in applied and "gloo_fsdp_sum" in applied

    import torchtitan.train  # noqa: F401  (loads every module that copies device_type)
    from torchtitan.components import metrics
    from torchtitan.distributed import parallel_dims, utils as dist_utils
    from torchtitan.models.common import token_dispatcher
    from torchtitan.tools import profiler, utils

    shim = patches.cpu_device.CPU_DEVICE_MODULE
    assert utils.get_device_info() == ("cpu", shim)
    for module in (utils, metrics, dist_utils, parallel_dims, token_dispatcher):
        assert module.device_type == "cpu", module.__name__
    for module in (utils, metrics, dist_utils, profiler, token_dispatcher):
        assert module.device_module is shim, module.__name__
    assert sorted(patches.cpu_device.COPYING_MODULES) == sorted(m.__name__ for m in (
        metrics, parallel_dims, dist_utils, token_dispatcher, profiler))
    stale = [
        name
        for name, module in sys.modules.items()
        if name.startswith("torchtitan")
        and (
            getattr(module, "device_type", None) == "cuda"
            or getattr(module, "device_module", None) is torch.cuda
        )
    ]
    assert stale == []

    shim.set_device(torch.device("cpu:0"))
    shim.synchronize()
    shim.reset_peak_memory_stats()
    shim.empty_cache()
    assert shim.current_device() == 0
    assert shim.device_count() >= 1
    assert shim.get_device_properties("cpu").total_memory > 2**20
    assert shim.memory_stats() == {}
    monitor = metrics.build_device_memory_monitor()
    assert monitor.device == torch.device("cpu")
    assert monitor.get_peak_stats().num_ooms == -1
    assert metrics.DeviceMemoryMonitor().device == torch.device("cpu:0")

    # Idempotent: same result, nothing wrapped twice.
    assert patches.apply_patches() == applied
    from torch.distributed.fsdp import FSDPModule

    wrapper = patches.gloo_fsdp_sum._set_gradient_divide_factor
    assert FSDPModule.set_gradient_divide_factor is wrapper
    assert utils.device_module is shim


@requires_no_accelerator
def test_cpu_device_is_still_needed():
    """Unpatched, torchtitan 0.3.0 falls back to CUDA on a machine without an accelerator."""
    script = "from torchtitan.tools import utils; import torch; print(utils.device_type, utils.device_module is torch.cuda)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cuda", "True"]


def test_registry_lists_every_patch_module():
    assert list(patches.PATCHES) == ["triton_stub", "cpu_device", "cpu_quiet", "gloo_fsdp_sum", "set_timeout"]
    for module in patches.PATCHES.values():
        doc = module.__doc__
        assert "What:" in doc and "Versions:" in doc and "Why:" in doc
        assert "When:" in doc and "torchtitan 0.3.0" in doc


def test_set_timeout_is_given_to_a_torch_without_it(monkeypatch):
    """torchtitan 0.3.0's ``set_pg_timeouts`` (called before our first step) needs ``torch.distributed.set_timeout``,
    which torch 2.13 and the GPU machines' 2.11 lack: without the patch it raises, with it the timeout reaches
    ``_set_pg_timeout`` for every group. On this torch (2.15) the patch stays out. Mutation: ``apply`` installing
    nothing (the second call raises) or passing another group."""
    from torch.distributed import distributed_c10d
    from torchtitan.distributed import utils as dist_utils

    assert patches.set_timeout.apply() is (not hasattr(torch.distributed, "set_timeout") or
                                           torch.distributed.set_timeout is patches.set_timeout._set_timeout)
    monkeypatch.delattr(torch.distributed, "set_timeout")
    monkeypatch.setattr(torch.distributed, "barrier", lambda **_: None)
    monkeypatch.setattr(dist_utils, "device_module", types.SimpleNamespace(current_device=lambda: 0,
                                                                           synchronize=lambda: None))
    calls = []
    monkeypatch.setattr(distributed_c10d, "_set_pg_timeout", lambda timeout, group: calls.append((timeout, group)))
    mesh = types.SimpleNamespace(get_group=lambda: "dp_group")
    dims = types.SimpleNamespace(get_all_one_dimensional_meshes=lambda: {"dp": mesh})
    with pytest.raises(AttributeError, match="set_timeout"):
        dist_utils.set_pg_timeouts(timedelta(seconds=7), dims)
    assert patches.set_timeout.apply() is True
    dist_utils.set_pg_timeouts(timedelta(seconds=7), dims)
    assert calls == [(timedelta(seconds=7), "dp_group"), (timedelta(seconds=7), None)]


def test_cpu_quiet_drops_only_the_gpu_probing_warnings(capsys):
    """torchtitan's GPU-probing and default-config warnings and torch's triton one are dropped on CPU (issue 27's
    paper cuts); any other record stays."""
    import logging

    assert patches.cpu_quiet.apply() and patches.cpu_quiet.apply()  # idempotent
    assert logging.getLogger().filters.count(patches.cpu_quiet._FILTER) == 1
    handler = logging.StreamHandler()
    logging.getLogger().addHandler(handler)
    try:
        logging.getLogger().warning("Error running lspci: [Errno 2] No such file or directory: 'lspci'")
        logging.getLogger().warning("Peak flops undefined for: CPU, fallback to A100")
        logging.getLogger().warning("initial_load_model_only=True has no effect without an initial_load_path.")
        logging.getLogger("torch.utils.flop_counter").warning(
            "triton not found; flop counting will not work for triton kernels")
        logging.getLogger().warning("a warning that matters")
        logging.getLogger("torch.utils.flop_counter").warning("another torch warning")
    finally:
        logging.getLogger().removeHandler(handler)
    err = capsys.readouterr().err
    assert "a warning that matters" in err and "another torch warning" in err  # (torch's handler adds a prefix)
    assert "lspci" not in err and "Peak flops" not in err and "initial_load" not in err and "triton" not in err


def test_another_torchtitan_is_refused_in_one_line(monkeypatch, capsys):
    """Switch, do not support both: 0.2.2 (or any other release) is refused before anything is patched, naming
    what to install and the last commit for 0.2.2."""
    from torchtitan_flux.errors import TorchtitanVersionError

    assert patches.importlib.metadata.version("torchtitan") == "0.3.0"
    monkeypatch.setattr(patches.importlib.metadata, "version", lambda _: "0.2.2")
    with pytest.raises(TorchtitanVersionError) as e:
        patches.apply_patches()
    assert str(e.value) == ("torchtitan 0.2.2 is installed; torchtitan_flux runs on torchtitan 0.3.0 only: pip install "
                            "torchtitan==0.3.0 (scripts/setup.sh), or torchtitan_flux at commit 420b2f0 for "
                            "torchtitan 0.2.2")
    from torchtitan_flux.train import _report

    assert _report(e.value) == 1  # how the run ends: that line, no traceback
    assert capsys.readouterr().err == f"error: {e.value}\n"


def test_triton_stub_is_a_no_op_when_triton_imports(monkeypatch):
    kernels = patches.triton_stub.KERNELS_MODULE
    monkeypatch.delitem(sys.modules, kernels, raising=False)
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    assert patches.triton_stub.apply() is False
    assert kernels not in sys.modules


_TRITON_BLOCKED_SCRIPT = """
import sys

class BlockTriton:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, BlockTriton())

import torchtitan  # 0.3.0's package itself imports without triton; its models and trainer do not
try:
    import torchtitan.models.llama3
except ModuleNotFoundError as e:
    assert e.name == "triton", e
else:
    raise AssertionError("torchtitan's models imported without triton and without the patch")
for name in [n for n in sys.modules if n.startswith("torchtitan.") and not n.startswith("torchtitan.config")]:
    del sys.modules[name]

from torchtitan_flux.patches import apply_patches

assert "triton_stub" in apply_patches()
assert "triton_stub" in apply_patches()
import torchtitan.train
import torchtitan.models.llama3
import torchtitan.models.qwen3
import torch
import torch._dynamo
from torch.utils._triton import has_triton
from torchtitan.distributed.minimal_async_ep import kernels

assert "triton" not in sys.modules and "triton.language" not in sys.modules
assert not has_triton()
assert torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2)).tolist() == [2, 2]
try:
    kernels._copy_full_counts_to_peer_ptrs_kernel[(1, 1)]()
except RuntimeError as e:
    assert "triton is not installed" in str(e)
else:
    raise AssertionError("the stubbed triton kernel ran")
print("OK")
"""


def test_triton_stub_without_triton():
    result = subprocess.run(
        [sys.executable, "-c", _TRITON_BLOCKED_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "OK"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_and_replica(parallel_dims, parallelism, model_dir):
    """The tiny model of ``model_dir`` built and sharded as torchtitan's trainer does (FSDP2 on ``parallel_dims``),
    and a one-process replica holding the same initial weights."""
    from torchtitan.config import CompileConfig, TrainingConfig

    from torchtitan_flux.models import families

    config = families.config_from_hf_dir(model_dir, max_seq_len=64)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    model = families.model_spec(model_dir).parallelize_fn(
        model, parallel_dims=parallel_dims, training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism, compile_config=CompileConfig(), ac_config=None, dump_folder="")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    replica = families.config_from_hf_dir(model_dir, max_seq_len=64).build()
    with torch.no_grad():
        replica.init_weights(buffer_device=None)
        for name, param in replica.named_parameters():
            param.copy_(dict(model.named_parameters())[name].full_tensor())
    return model, replica


def _fsdp_train_step(parallel_dims, parallelism, model_dir, tokens, rank):
    """One SGD step of the tiny llama under torchtitan's FSDP; checks it against a local replica."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchtitan.distributed import utils as dist_utils

    model, replica = _sharded_and_replica(parallel_dims, parallelism, model_dir)

    def loss_fn(module, batch):
        logits = module(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

    lr = 0.5
    with dist_utils.get_spmd_context(parallel_dims=parallel_dims)():
        loss = loss_fn(model, tokens[rank])
        loss.backward()
    torch.optim.SGD(model.parameters(), lr=lr).step()
    assert torch.isfinite(loss)

    # gradient_divide_factor=1.0: FSDP must sum, not average, the ranks' gradients.
    sum(loss_fn(replica, local_tokens) for local_tokens in tokens).backward()
    torch.optim.SGD(replica.parameters(), lr=lr).step()
    full = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    expected = torch.cat([p.detach().flatten() for p in replica.parameters()])
    torch.testing.assert_close(full, expected, rtol=1e-4, atol=1e-5)
    gathered = [torch.empty_like(full) for _ in range(2)]
    dist.all_gather(gathered, full)
    assert torch.equal(gathered[0], gathered[1])


def _worker(rank: int, port: int, spmd_backend: str, model_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
    )
    torch.set_num_threads(1)
    from torch.distributed.fsdp import FSDPModule

    from torchtitan_flux.models import families  # noqa: F401  (importing it applies every patch)

    # undone, to show below that it is needed
    FSDPModule.set_gradient_divide_factor = patches.gloo_fsdp_sum._original_set_gradient_divide_factor

    import torch.distributed as dist
    from torchtitan.config import CommConfig, DebugConfig, ParallelismConfig
    from torchtitan.distributed import ParallelDims, utils as dist_utils
    from torchtitan.tools import utils

    # What Trainer.__init__ / init_distributed do before building the model.
    utils.device_module.set_device(utils.get_local_device())
    world_size = dist_utils.init_distributed(CommConfig(trace_buf_size=0))  # no flight-recorder dump folder
    assert dist.get_backend() == "gloo"
    parallelism = ParallelismConfig(data_parallel_shard_degree=2, spmd_backend=spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    dist_utils.set_spmd_backend(spmd_backend)
    dist_utils.set_determinism(parallel_dims, torch.device("cpu"), DebugConfig(seed=0), distinct_seed_mesh_dims=["pp"])
    dist_utils.set_pg_timeouts(timedelta(seconds=60), parallel_dims)  # torch.distributed.set_timeout: torch >= 2.14
    tokens = torch.randint(3, 259, (2, 2, 33), generator=torch.Generator().manual_seed(0))

    # Without the gloo patch torchtitan's FSDP setup cannot reduce gradients over gloo.
    with pytest.raises(RuntimeError, match="PREMUL_SUM"):
        _fsdp_train_step(parallel_dims, parallelism, model_dir, tokens, rank)

    assert patches.apply_patches() == ["triton_stub", "cpu_device", "cpu_quiet", "gloo_fsdp_sum"]
    _fsdp_train_step(parallel_dims, parallelism, model_dir, tokens, rank)
    dist.destroy_process_group()
    # Skip the interpreter's finalisation (as torchtitan_flux/train.py does): torch's gloo teardown racing its own
    # threads aborts now and then after the work is done ("terminate called without an active exception"; CI).
    os._exit(0)


@requires_no_accelerator
@pytest.mark.parametrize("spmd_backend", ["spmd_types", "partial_dtensor"])
def test_fsdp_over_gloo_two_processes(spmd_backend, tiny_model_dir):
    """Both of 0.3.0's FSDP backends train over gloo on torch 2.15 with the patch (on torch 2.13, ``spmd_types``
    failed: "parameters must be DTensors"), and neither does without it."""
    mp.spawn(_worker, args=(_free_port(), spmd_backend, str(tiny_model_dir)), nprocs=2, join=True)


def _tied_worker(rank: int, port: int, spmd_backend: str, model_dir: str, out: str) -> None:
    """Two Adam steps of a tied tiny llama under torchtitan's FSDP on 2 gloo ranks against a one-process replica
    trained on both ranks' tokens; rank 0 writes the largest parameter difference to ``out``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    patches.apply_patches()
    import torch.nn.functional as F
    from torchtitan.config import CommConfig, ParallelismConfig
    from torchtitan.distributed import ParallelDims, utils as dist_utils
    from torchtitan.tools import utils

    utils.device_module.set_device(utils.get_local_device())
    world_size = dist_utils.init_distributed(CommConfig(trace_buf_size=0))
    parallelism = ParallelismConfig(data_parallel_shard_degree=2, spmd_backend=spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    dist_utils.set_spmd_backend(spmd_backend)
    model, replica = _sharded_and_replica(parallel_dims, parallelism, model_dir)
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert replica.lm_head.weight is replica.tok_embeddings.weight
    opt, replica_opt = (torch.optim.Adam(m.parameters(), lr=3e-3) for m in (model, replica))
    generator = torch.Generator().manual_seed(0)

    def loss_fn(module, batch):
        return F.cross_entropy(module(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    for _ in range(2):
        tokens = torch.randint(3, 259, (2, 2, 33), generator=generator)
        with dist_utils.get_spmd_context(parallel_dims=parallel_dims)():
            loss_fn(model, tokens[rank]).backward()
        opt.step()
        opt.zero_grad()
        sum(loss_fn(replica, t) for t in tokens).backward()
        replica_opt.step()
        replica_opt.zero_grad()
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    diff = max((full[name] - p).abs().max().item() for name, p in replica.named_parameters())
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr(diff))
    torch.distributed.destroy_process_group()
    os._exit(0)


@requires_no_accelerator
def test_spmd_types_trains_a_tied_model_wrong_over_two_ranks(tiny_model_dir, tmp_path):
    """Why ``parallelism.spmd_backend`` defaults to "partial_dtensor" and validation refuses "spmd_types" for a tied
    model on several ranks: under torchtitan 0.3.0's default "spmd_types" (torch 2.15) a tied model's parameters
    after two Adam steps at lr 3e-3 differ from a one-process replica's by more than the learning rate (measured
    ~8e-3); under "partial_dtensor" by float rounding (~1e-7); an untied model is exact under both
    (test_fsdp_over_gloo_two_processes). When this test fails on "spmd_types", upstream has fixed it: drop the
    refusal and the default."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    tied = tmp_path / "tied"
    tied.mkdir()
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    diffs = {}
    for backend in ("spmd_types", "partial_dtensor"):
        out = tmp_path / f"{backend}.txt"
        mp.spawn(_tied_worker, args=(_free_port(), backend, str(tied), str(out)), nprocs=2, join=True)
        diffs[backend] = float(out.read_text())
    assert diffs["partial_dtensor"] < 1e-5 and diffs["spmd_types"] > 1e-3, diffs
