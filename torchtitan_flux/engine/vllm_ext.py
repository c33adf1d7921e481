"""vLLM worker extension: receive torchtitan_flux weight pushes through vLLM's official RL weight-update API.

Runs INSIDE the vLLM server's worker processes, so it imports only torch, vllm and torch-only parts of the package
(never torchtitan). ``scripts/launch_vllm.sh`` loads it (``--worker-extension-cls``) and picks the ``gloo``
transfer backend, which importing this module registers (CPU servers: vLLM's own backends all need CUDA). GPU
servers use vLLM's own ``nccl`` backend (``engine/vllm_nccl.py``) and the extension only serves ``flux_model_info``.

Wire protocol (driven by ``engine.vllm.VllmEngine``; broadcasts from ``wire/transport.py``):
* ``/init_weight_transfer_engine {"init_info": FluxInitInfo}``: join a 2-member group on the trainer's store
  (after ``transport.handshake`` when the server holds ``$TORCHTITAN_FLUX_TOKEN``); blocks until the trainer,
  concurrently, creates its side.
* ``/start_weight_update``: open vLLM's layerwise-reload session (plain ``load_weights`` fails on CPU).
* ``/update_weights {"update_info": FluxUpdateInfo}``, once per bucket in order: the first call first receives the
  push header (``transport``: int64 ``[MAGIC, version, base, count per bucket]``) and checks it is ``version``;
  each then receives ONE bucket (HF names and layout): whole, or (sparse pushes, ``init_info.patches``) a patch
  applied to this server's copy of the bucket as last pushed, which must be version ``base``; and hands the
  bucket's views to ``model.load_weights``. So a sparse push moves only the changed elements over the wire and
  loads through the same reload as a dense one (bit-exact; costs one host copy of the weights in the server).
* ``/finish_weight_update {"weight_version": "N"}``: finalize the reload.
``FluxWorkerExtension`` adds ``flux_model_info`` (for the start-up checks) and ``flux_weights_checksum`` (sha256 of
the newest push the trainer asked to hash) to ``/collective_rpc``. Simplification: tensor parallelism 1.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from torchtitan_flux import compat
from torchtitan_flux.auth import read_token
from torchtitan_flux.wire import cuda_rules, transport

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXT_VERSION = 1


@dataclass
class FluxInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    store_prefix: str
    backend: str = "gloo"
    timeout_s: float = 600.0
    checksum: bool = True  # hash every received bucket (flux_weights_checksum); off for very large models
    patches: bool = False  # the trainer may send sparse pushes: keep a copy of each bucket as last pushed

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"init_info.backend = {self.backend!r}; allowed: 'gloo' | 'nccl'")
        if not self.store_prefix:
            raise ValueError("init_info.store_prefix must be a non-empty string")
        if self.world_size != self.rank_offset + 1:
            raise ValueError(f"init_info world_size={self.world_size}, rank_offset={self.rank_offset}: torchtitan_flux "
                             "weight sync supports one trainer rank and one worker (tensor_parallel_size 1)")


@dataclass
class FluxUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket: int  # index of this bucket in the push
    num_buckets: int
    version: int  # the trainer's policy version of this push
    header_len: int = 0  # > 0 on the first bucket: receive the push header (int64[header_len]) first
    checksum: bool = True  # hash this push's buckets (the trainer samples: weight_sync.verify_every, and the last)

    def __post_init__(self) -> None:
        n = len(self.names)
        if n == 0 or len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(f"update_info needs equally long, non-empty names/dtype_names/shapes; got "
                             f"{n}/{len(self.dtype_names)}/{len(self.shapes)}")
        if len(set(self.dtype_names)) != 1 or self.dtype_names[0] not in _DTYPES:
            raise ValueError(f"a bucket holds one dtype of {sorted(_DTYPES)}; got {sorted(set(self.dtype_names))}")
        if not 0 <= self.bucket < self.num_buckets:
            raise ValueError(f"update_info.bucket = {self.bucket} not in [0, {self.num_buckets})")
        if (self.bucket == 0) != (self.header_len > 0):
            raise ValueError("the push header travels with bucket 0 and only with it")


class _FluxWeightTransferEngine(WeightTransferEngine[FluxInitInfo, FluxUpdateInfo]):
    """Receives the bucketed pushes of torchtitan_flux (see the module docstring)."""

    init_info_cls = FluxInitInfo
    update_info_cls = FluxUpdateInfo
    supports_draft_weight_update = False
    BACKEND = ""

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self._store = None
        self._checksum_enabled = True
        self._hash = None
        self._next_bucket = 0
        self._push_version = None
        self.last_checksum: tuple[int, str | None] = (-1, None)
        self._patches = False
        self._counts: list[int] = []  # per bucket, from the push header (transport.DENSE: whole)
        self._held: list[torch.Tensor | None] = []  # sparse groups: each bucket as last pushed
        self._held_version = -1  # the version ``_held`` holds whole; -1 while a push is being received

    def init_transfer_engine(self, init_info: FluxInitInfo) -> None:
        if init_info.backend != self.BACKEND:
            raise ValueError(f"the trainer asks for a {init_info.backend!r} weight-sync group but this server was "
                             f"started with --weight-transfer-config backend for {self.BACKEND!r}")
        pc = self.parallel_config
        if pc.world_size * pc.data_parallel_size != 1:
            raise ValueError("torchtitan_flux weight sync supports tensor/pipeline/data parallel size 1 per server")
        self.shutdown()  # a re-join (resync after a failure) replaces the previous group
        host = init_info.master_address
        store = transport.connect_store(host, init_info.master_port, init_info.timeout_s, is_master=False)
        transport.handshake(store, init_info.store_prefix, read_token(), transport.ENGINE, init_info.timeout_s)
        group = compat.new_weight_sync_group(
            self.BACKEND, dist.PrefixStore(init_info.store_prefix, store), init_info.rank_offset + pc.rank,
            init_info.world_size, timedelta(seconds=init_info.timeout_s), device=self.device,
            listen_host=transport.listen_address(host),
        )
        self.group, self._store = group, store
        self._checksum_enabled = init_info.checksum
        self._patches, self._held, self._held_version = init_info.patches, [], -1  # a new group: dense first

    def shutdown(self) -> None:
        self.group = None  # raw groups are not registered with torch.distributed; dropping them closes them
        self._store = None

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._next_bucket = 0
        self._push_version = None
        self._hash = None  # created at bucket 0 when the push asks for it (FluxUpdateInfo.checksum)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        _refresh_tied_lm_head(self.model, self.model_config)
        if self._push_version is not None and self._hash is not None:  # the newest hashed push's (version, sha256)
            self.last_checksum = (self._push_version, self._hash.hexdigest())
        if self._patches and self._push_version is not None and self._next_bucket == len(self._held):
            self._held_version = self._push_version

    def _broadcast(self, t: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()

    def receive_weights(self, info: FluxUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("weight-sync group not initialized: call /init_weight_transfer_engine first")
        if info.bucket != self._next_bucket:
            raise RuntimeError(f"bucket {info.bucket} arrived, expected bucket {self._next_bucket} "
                               "(buckets go in order)")
        if info.header_len:
            header = torch.empty(info.header_len, dtype=torch.int64, device=self._wire_device)
            self._broadcast(header)
            h = transport.decode_header(header)
            if h.version != info.version:
                raise RuntimeError(f"push header carries version {h.version}, the HTTP request says {info.version}")
            if len(h.counts) != info.num_buckets:
                raise RuntimeError(f"push header lists {len(h.counts)} buckets, the HTTP request says {info.num_buckets}")
            if h.base >= 0 and (not self._patches or h.base != self._held_version):
                raise RuntimeError(f"push {h.version} patches version {h.base}, but this server holds "
                                   f"{self._held_version if self._patches else 'no copy'}; it needs a dense push")
            if self._patches:
                self._held, self._held_version = self._held or [None] * info.num_buckets, -1
            self._counts, self._push_version = h.counts, h.version
            self._hash = hashlib.sha256() if (self._checksum_enabled and info.checksum) else None
        elif info.version != self._push_version:
            raise RuntimeError(f"bucket {info.bucket} of version {info.version} inside the push of "
                               f"{self._push_version}")
        dtype = _DTYPES[info.dtype_names[0]]
        numels = [_numel(s) for s in info.shapes]
        count = self._counts[info.bucket]
        if count == transport.DENSE:
            flat = torch.empty(sum(numels), dtype=dtype, device=self._wire_device)  # fresh per bucket: the reload
            self._broadcast(flat)  # may keep views of it until its layer is complete
        else:  # a patch of the bucket as last pushed (never written in place: the reload may hold views of it)
            flat = self._held[info.bucket].clone()
            if count:
                idx = torch.empty(count, dtype=transport.index_dtype(flat.numel()), device=self._wire_device)
                vals = torch.empty(count, dtype=dtype, device=self._wire_device)
                self._broadcast(idx)
                self._broadcast(vals)
                transport.apply_patch(flat, idx, vals)
        if self._patches:
            self._held[info.bucket] = flat
        if self._hash is not None:
            self._hash.update(flat.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        weights, off = [], 0
        for name, shape, n in zip(info.names, info.shapes, numels):
            weights.append((name, flat[off : off + n].view(shape)))
            off += n
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(weights)
        self._next_bucket += 1

    @property
    def _wire_device(self) -> torch.device:
        return torch.device("cpu") if self.BACKEND == "gloo" else self.device


class FluxGlooWeightTransferEngine(_FluxWeightTransferEngine):
    BACKEND = "gloo"


def _refresh_tied_lm_head(model, model_config) -> None:
    """Make a tied ``lm_head`` compute with the embedding just pushed: the reload never re-processes it, so its
    packed GEMM state stays the initial embedding's (vLLM 0.32 CPU; docs/engines.md)."""
    if not getattr(model_config.hf_config, "tie_word_embeddings", False):
        return
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    embeds = [m for m in model.modules() if type(m) is VocabParallelEmbedding]
    if len(heads) != 1 or len(embeds) != 1 or heads[0].weight.shape != embeds[0].weight.shape:
        return
    head, embed = heads[0], embeds[0]
    if head.weight is not embed.weight:
        head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


try:  # GPU servers use vLLM's own "nccl" engine instead (engine/vllm_nccl.py)
    WeightTransferEngineFactory.register_engine("gloo", FluxGlooWeightTransferEngine)
except ValueError:  # registered already (module imported twice, or another extension owns the name)
    pass


HF_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "tie_word_embeddings", "architectures", "eos_token_id")


class FluxWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; methods callable via ``/collective_rpc``."""

    def flux_model_info(self) -> dict:
        cfg = self.vllm_config.model_config
        hf = cfg.hf_text_config if hasattr(cfg, "hf_text_config") else cfg.hf_config
        engine = getattr(self, "weight_transfer_engine", None)
        pc = self.vllm_config.parallel_config
        return {
            "ext_version": EXT_VERSION,
            "model": str(cfg.model),
            "dtype": str(cfg.dtype).removeprefix("torch."),
            "max_model_len": int(cfg.max_model_len),
            "hf_config": {k: getattr(hf, k, None) for k in HF_CONFIG_KEYS},
            "transfer_engine": type(engine).__name__ if engine is not None else None,
            # ours: "gloo" / "nccl"; vLLM's own NCCL engine (GPU): "vllm_nccl" (engine/vllm_nccl.py)
            "transfer_backend": getattr(engine, "BACKEND", None)
            or ("vllm_nccl" if type(engine).__name__ == "NCCLWeightTransferEngine" else None),
            "world_size": int(pc.world_size * pc.data_parallel_size),
            "nccl_version": cuda_rules.nccl_version() or "none",  # compared by the trainer (cuda_rules rule 7)
        }

    def flux_weights_checksum(self) -> dict:
        engine = getattr(self, "weight_transfer_engine", None)
        version, digest = getattr(engine, "last_checksum", (-1, None))
        return {"version": version, "sha256": digest}
