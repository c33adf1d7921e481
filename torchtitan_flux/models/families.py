"""Trainer-side model families: one TrainSpec per supported family, HF config -> torchtitan args, models, adapters.

The family comes from ``{model.hf_assets_path}/config.json`` alone (``select_model``). ``llama``: torchtitan's
llama3 model and adapter, plus ``tie_word_embeddings`` and an explicit ``head_dim``; ``qwen3``: torchtitan's
``Qwen3Model``, unchanged; ``qwen2``: the same with ``qk_norm=False`` and q/k/v biases. HF weights: ``hf_weights.py``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # torchtitan 0.2.2 needs a few patches on CPU-only machines (e.g. no triton).
    from torchtitan_flux.patches import apply_patches as _apply_patches  # type: ignore[attr-defined]
except ImportError:
    _apply_patches = None
if _apply_patches is not None:
    _apply_patches()

import torch
from torch import nn

from torchtitan.models.llama3 import Llama3StateDictAdapter, Transformer, TransformerModelArgs
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.models.llama3.model.model import precompute_freqs_cis
from torchtitan.models.qwen3 import Qwen3Model, Qwen3ModelArgs
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter

from torchtitan_flux.models import hf

FLUX_FLAVOR = "hf"
# family (torchtitan_flux.models.hf.SUPPORTED) -> the TrainSpec name registered for it
FAMILY_SPECS = {"llama": "flux_llama", "qwen3": "flux_qwen3", "qwen2": "flux_qwen2"}


def torchtitan_ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Hidden size of torchtitan's llama3 ``FeedForward`` (``TransformerBlock`` passes ``4 * dim``)."""
    hidden_dim = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden_dim = int(ffn_dim_multiplier * hidden_dim)
    return multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)


def solve_ffn_args(dim: int, intermediate_size: int) -> tuple[int, float | None]:
    """(multiple_of, ffn_dim_multiplier) making torchtitan's FFN hidden dim exactly ``intermediate_size``."""
    if int(intermediate_size) != intermediate_size or intermediate_size <= 0 or dim <= 0:
        raise ValueError(f"cannot reproduce intermediate_size={intermediate_size!r} with hidden_size={dim!r}: "
                         "both must be positive integers")
    intermediate_size = int(intermediate_size)
    base = int(2 * (4 * dim) / 3)
    candidates: list[tuple[int, float | None]] = [(256, None), (1024, 1.3), (4096, 1.3), (4096, 1.2),
                                                  (intermediate_size, None)]
    if base > 0:
        candidates += [(intermediate_size, (intermediate_size + 0.5) / base),
                       (intermediate_size, intermediate_size / base)]
    for multiple_of, mult in candidates:
        if torchtitan_ffn_hidden_dim(dim, multiple_of, mult) == intermediate_size:
            return multiple_of, mult
    raise ValueError(f"cannot choose multiple_of/ffn_dim_multiplier so that torchtitan's FeedForward hidden dim "
                     f"equals intermediate_size={intermediate_size} for hidden_size={dim}")


def rope_scaling_args(rs: dict[str, Any]) -> RoPEScalingArgs:
    """torchtitan's llama3 RoPE scaling from ``hf.architecture``'s ``rope_scaling`` (factor 1: identity)."""
    return RoPEScalingArgs(
        scaling_factor=rs["factor"], low_freq_factor=rs["low_freq_factor"], high_freq_factor=rs["high_freq_factor"],
        original_max_position_embeddings=rs["original_max_position_embeddings"],
    )


def _shared_fields(a: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields torchtitan's llama3 and qwen3 args name alike, from ``hf.architecture``'s ``a``."""
    eos = hf.eos_token_ids(cfg)
    return dict(
        dim=a["dim"], n_layers=a["n_layers"], n_heads=a["n_heads"], n_kv_heads=a["n_kv_heads"],
        head_dim=a["head_dim"], vocab_size=a["vocab_size"], norm_eps=a["norm_eps"], rope_theta=a["rope_theta"],
        attn_type="sdpa", attn_mask_type="causal", eos_id=eos[0] if eos else 0,
    )


def hf_config_to_args_fields(cfg: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """``FluxLlamaArgs`` field values for a HF Llama config dict (raises ValueError if unsupported)."""
    a = hf.architecture(cfg, where)
    if a["family"] != "llama":
        raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} is not a llama config")
    multiple_of, ffn_dim_multiplier = solve_ffn_args(a["dim"], a["intermediate_size"])
    return dict(**_shared_fields(a, cfg), multiple_of=multiple_of, ffn_dim_multiplier=ffn_dim_multiplier,
                rope_scaling_args=rope_scaling_args(a["rope_scaling"]), tie_word_embeddings=a["tied"])


def qwen_config_to_args_fields(cfg: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """``FluxQwenArgs`` field values for a HF Qwen3 / Qwen2 config dict (raises ValueError if unsupported)."""
    a = hf.architecture(cfg, where)
    if a["family"] not in ("qwen3", "qwen2"):
        raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} is not a qwen3/qwen2 config")
    return dict(**_shared_fields(a, cfg), hidden_dim=a["intermediate_size"], qk_norm=a["qk_norm"],
                qkv_bias=a["qkv_bias"], enable_weight_tying=a["tied"])


class _FromHF:
    """Mixin: dataclass args filled from ``{job_config.model.hf_assets_path}/config.json`` by ``_fields``."""

    _fields = staticmethod(hf_config_to_args_fields)

    def apply_hf_config(self, cfg: dict[str, Any], where: str = "config.json"):
        for k, v in self._fields(cfg, where).items():
            setattr(self, k, v)
        return self

    @classmethod
    def from_hf_dir(cls, hf_dir: str | os.PathLike, max_seq_len: int | None = None):
        args = cls().apply_hf_config(hf.read_config(hf_dir), str(Path(hf_dir) / "config.json"))
        if max_seq_len is not None:
            args.max_seq_len = int(max_seq_len)
        return args

    def update_from_config(self, job_config, **kwargs) -> None:
        hf_dir = job_config.model.hf_assets_path
        self.apply_hf_config(hf.read_config(hf_dir), str(Path(hf_dir) / "config.json"))
        super().update_from_config(job_config, **kwargs)  # max_seq_len from training.seq_len


@dataclass
class FluxLlamaArgs(_FromHF, TransformerModelArgs):
    """torchtitan llama3 args filled from a HF Llama ``config.json``."""

    tie_word_embeddings: bool = False
    """The output projection is the token embedding (one parameter; HF ``tie_word_embeddings``)."""
    head_dim: int = 0
    """Width of one attention head; 0 means ``dim // n_heads`` (torchtitan llama3's own rule)."""


def _llama_head_dim(model_args) -> int:
    return getattr(model_args, "head_dim", 0) or model_args.dim // model_args.n_heads


class _LogitsFrom:
    """``forward(tokens, ..., logits_from=k)``: the logits of positions ``k:`` only, ``[B, L - k, V]``. GRPO needs
    logits only where a completion token is predicted; the prompt's positions before that would cost the output
    projection and the log-softmax over the whole vocabulary for nothing (TRL's ``logits_to_keep``; on the real model
    on CPU, ~20% of a training step). Every position still runs through the blocks (causal attention needs them).
    The slice is a pre-hook on this model's own ``output`` for the one call (FSDP's hooks on it run first)."""

    def forward(self, tokens: torch.Tensor, *args, logits_from: int = 0, **kwargs) -> torch.Tensor:
        if not logits_from:
            return super().forward(tokens, *args, **kwargs)
        handle = self.output.register_forward_pre_hook(lambda _m, a: (a[0][:, logits_from:], *a[1:]))
        try:
            return super().forward(tokens, *args, **kwargs)
        finally:
            handle.remove()


class FluxLlamaModel(_LogitsFrom, Transformer):
    """torchtitan's llama3 ``Transformer``, with ``tie_word_embeddings``, an explicit ``head_dim`` and
    ``logits_from``."""

    def __init__(self, model_args: FluxLlamaArgs):
        super().__init__(model_args)
        if getattr(model_args, "tie_word_embeddings", False):
            self.output.weight = self.tok_embeddings.weight
        hd = _llama_head_dim(model_args)
        if hd != model_args.dim // model_args.n_heads:
            for block in self.layers.values():
                attn = block.attention
                attn.head_dim = hd
                attn.wq = nn.Linear(model_args.dim, attn.n_heads * hd, bias=False)
                attn.wk = nn.Linear(model_args.dim, attn.n_kv_heads * hd, bias=False)
                attn.wv = nn.Linear(model_args.dim, attn.n_kv_heads * hd, bias=False)
                attn.wo = nn.Linear(attn.n_heads * hd, model_args.dim, bias=False)

    def _precompute_freqs_cis(self) -> torch.Tensor:  # called by torchtitan's __init__ and init_weights
        a = self.model_args
        return precompute_freqs_cis(_llama_head_dim(a), a.max_seq_len, a.rope_theta, a.rope_scaling_args)

    def init_weights(self, *args, **kwargs):
        if getattr(self.model_args, "tie_word_embeddings", False):  # ``to_empty`` may untie (as in Qwen3Model)
            self.output.weight = self.tok_embeddings.weight
        super().init_weights(*args, **kwargs)


class FluxLlamaStateDictAdapter(Llama3StateDictAdapter):
    """torchtitan's llama3 adapter; a tied model has no ``lm_head.weight`` in HF files."""

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = super().to_hf(state_dict)
        if getattr(self.model_args, "tie_word_embeddings", False):
            out.pop("lm_head.weight", None)
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        if getattr(self.model_args, "tie_word_embeddings", False):
            hf_state_dict = {**hf_state_dict, "lm_head.weight": hf_state_dict["model.embed_tokens.weight"]}
        return super().from_hf(hf_state_dict)

    # k's rows are the tensor's own, not torchtitan's ``dim // n_heads * n_kv_heads`` (wrong for explicit head_dim)
    def _permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return super()._permute(w, n_heads_arg)

    def _reverse_permute(self, w, n_heads_arg, dim1=None, dim2=None):
        return super()._reverse_permute(w, n_heads_arg)


@dataclass
class FluxQwenArgs(_FromHF, Qwen3ModelArgs):
    """torchtitan qwen3 args filled from a HF Qwen3 or Qwen2 ``config.json``."""

    _fields = staticmethod(qwen_config_to_args_fields)
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2 / Qwen2.5)."""


class FluxQwenModel(_LogitsFrom, Qwen3Model):
    """torchtitan's ``Qwen3Model``, with ``logits_from``; with ``qkv_bias`` (Qwen2) the q/k/v projections get biases
    (zero-initialised)."""

    def __init__(self, model_args: FluxQwenArgs):
        super().__init__(model_args)
        if getattr(model_args, "qkv_bias", False):
            for block in self.layers.values():
                attn = block.attention
                for name in ("wq", "wk", "wv"):
                    old = getattr(attn, name)
                    setattr(attn, name, nn.Linear(old.in_features, old.out_features, bias=True))

    def init_weights(self, *args, **kwargs):
        super().init_weights(*args, **kwargs)
        if getattr(self.model_args, "qkv_bias", False):
            with torch.no_grad():
                for block in self.layers.values():
                    for name in ("wq", "wk", "wv"):
                        getattr(block.attention, name).bias.zero_()


class FluxQwenStateDictAdapter(Qwen3StateDictAdapter):
    """torchtitan's qwen3 adapter plus the Qwen2 q/k/v bias names."""

    def __init__(self, model_args: FluxQwenArgs, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        if getattr(model_args, "qkv_bias", False):
            for hf_p, tt_p in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv")):
                self.from_hf_map[f"model.layers.{{}}.self_attn.{hf_p}.bias"] = f"layers.{{}}.attention.{tt_p}.bias"


def state_dict_adapter(model_args, hf_assets_path: str | None = None):
    """The family's HF <-> torchtitan state-dict adapter for ``model_args`` (names and q/k layout)."""
    if isinstance(model_args, Qwen3ModelArgs):
        return FluxQwenStateDictAdapter(model_args, hf_assets_path)
    return FluxLlamaStateDictAdapter(model_args, hf_assets_path)


def args_from_hf_dir(hf_dir: str | os.PathLike, max_seq_len: int | None = None):
    """The family's torchtitan model args for a HF folder (FluxLlamaArgs or FluxQwenArgs)."""
    fam = hf.family(hf.read_config(hf_dir), str(Path(hf_dir) / "config.json"))
    cls = FluxLlamaArgs if fam == "llama" else FluxQwenArgs
    return cls.from_hf_dir(hf_dir, max_seq_len)


def fsdp_tied(parallelize_fn):
    """``parallelize_fn`` made safe for a tied output projection under FSDP2, which refuses torchtitan's two groups
    ``tok_embeddings`` and ``[norm, output]`` holding one parameter: the three are hidden from ``parallelize_fn``
    and sharded as ONE group (not resharded after forward). Untied models and runs without FSDP: unchanged."""

    def parallelize(model, parallel_dims, job_config):
        out, emb = getattr(model, "output", None), getattr(model, "tok_embeddings", None)
        tied = out is not None and emb is not None and out.weight is emb.weight
        if not (tied and parallel_dims.fsdp_enabled):
            return parallelize_fn(model, parallel_dims, job_config)
        if parallel_dims.tp_enabled or parallel_dims.pp_enabled or parallel_dims.cp_enabled:
            raise ValueError("tied word embeddings are supported with FSDP/HSDP only (no TP, PP or CP)")
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from torchtitan.config import TORCH_DTYPE_MAP
        from torchtitan.models.llama3.infra.parallelize import disable_fsdp_gradient_division

        ends = {name: getattr(model, name) for name in ("tok_embeddings", "norm", "output")}
        for name in ends:
            setattr(model, name, None)
        try:
            model = parallelize_fn(model, parallel_dims, job_config)
        finally:
            for name, module in ends.items():
                setattr(model, name, module)
        t = job_config.training
        config = {
            "mesh": parallel_dims.get_mesh(["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]),
            "mp_policy": MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[t.mixed_precision_param],
                                              reduce_dtype=TORCH_DTYPE_MAP[t.mixed_precision_reduce]),
        }
        if t.enable_cpu_offload:
            config["offload_policy"] = CPUOffloadPolicy()
        fully_shard(list(ends.values()), **config, reshard_after_forward=False)
        disable_fsdp_gradient_division(model)
        return model

    return parallelize


def register_families():
    """Register the TrainSpecs of every family (``FAMILY_SPECS``, flavor ``hf``); idempotent. Returns the llama one."""
    from torchtitan.models import llama3, qwen3
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

    for fam, name in FAMILY_SPECS.items():
        base = llama3.get_train_spec() if fam == "llama" else qwen3.get_train_spec()
        spec = dataclasses.replace(
            base,
            model_cls=FluxLlamaModel if fam == "llama" else FluxQwenModel,
            model_args={FLUX_FLAVOR: FluxLlamaArgs() if fam == "llama" else FluxQwenArgs()},
            state_dict_adapter=FluxLlamaStateDictAdapter if fam == "llama" else FluxQwenStateDictAdapter,
            parallelize_fn=fsdp_tied(base.parallelize_fn),
            build_dataloader_fn=None, build_validator_fn=None, pipelining_fn=None,
        )
        try:
            register_train_spec(name, spec)
        except ValueError:
            pass  # already registered (register_train_spec raises on duplicates)
    return get_train_spec(FAMILY_SPECS["llama"])


def select_model(job_config):
    """A copy of ``job_config`` whose ``model.name`` is the TrainSpec of ``model.hf_assets_path``'s family;
    ValueError naming the supported families for any other model, before anything is built."""
    hf_dir = job_config.model.hf_assets_path
    name = FAMILY_SPECS[hf.family(hf.read_config(hf_dir), str(Path(hf_dir) / "config.json"))]
    return dataclasses.replace(job_config, model=dataclasses.replace(job_config.model, name=name))
