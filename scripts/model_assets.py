"""Locally built model assets: a byte-level tokenizer and tiny randomly initialised Llama-3 models.

Nothing here downloads anything. ``build_model_dir`` writes a folder laid out like a Hugging Face Llama
checkpoint (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``, ...) that
both torchtitan (``--model.hf_assets_path``) and the rollout engines load.

The weights are produced by the trainer's own model of the folder's ``config.json`` (``families.model_config``:
torchtitan's ``Llama3Model``; ``init_weights()`` under ``torch.manual_seed(seed)``) and converted to HF names with
its state-dict adapter, so the folder round-trips exactly through
``torchtitan_flux.models.hf_weights.load_hf_weights``. torchtitan 0.3.0 draws the very weights torchtitan 0.2.2's
llama3 ``Transformer`` drew (same initialisers, same order): a folder built on either is the same, byte for byte.

Layout note: the weights are one ``model.safetensors`` and there is deliberately NO
``model.safetensors.index.json``. torchtitan's ``StateDictAdapter.__init__`` parses the shard number out of
every ``weight_map`` file name with ``re.search(r"\\d+", name).group(0)``, which raises for the name
``model.safetensors``; without an index it only logs a warning (and HF-format saves go to a single file),
and ``HuggingFaceStorageReader`` globs ``*.safetensors`` without needing an index either. Sharded folders
(``model-0000N-of-0000M.safetensors`` + index, as downloaded from the Hub) are read by ``load_hf_weights``.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any

# Token ids of the byte-level tokenizer.
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
BYTE_OFFSET = len(SPECIAL_TOKENS)  # byte b has token id BYTE_OFFSET + b
# A chat template for the tiny model, which has none (``build_chat_model_dir`` writes the chat variant with it, for
# multi-turn episodes): one message per block, <|bos|> role, newline, content, <|eos|> (the EOS, where a turn stops).
TINY_CHAT_TEMPLATE = ("{%- for m in messages %}{{ '<|bos|>' + m['role'] + '\\n' + m['content'] + '<|eos|>' }}"
                      "{%- endfor %}{%- if add_generation_prompt %}{{ '<|bos|>assistant\\n' }}{%- endif %}")
VOCAB_SIZE = BYTE_OFFSET + 256  # 259
# The chat variant's stop tokens besides EOS: an eighth of the bytes. The random weights spread a turn's tokens over
# all 256 bytes and almost never sample EOS, so every turn would run to its budget, where an episode ends without
# stepping its environment (docs/environments.md, limits); with these, a turn is ~8 tokens.
CHAT_STOP_BYTES = b"abcdefghijklmnopqrstuvwxyzABCDEF"
CHAT_STOP_IDS = [EOS_ID, *(BYTE_OFFSET + b for b in CHAT_STOP_BYTES)]

# RoPE scaling written to config.json: exactly torchtitan's ``RoPE.Config`` llama defaults (llama3 scaling).
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Flavor table. ``multiple_of``/``ffn_dim_multiplier`` are torchtitan's FeedForward sizing knobs; the
# resulting hidden size is written to config.json as ``intermediate_size``.
# Parameter counts (untied embeddings, vocab 259): tiny = 279,488; small = 1,542,528; medium ~ 25M.
_SHARED = dict(n_kv_heads=2, vocab_size=VOCAB_SIZE, multiple_of=256, ffn_dim_multiplier=None, norm_eps=1e-5,
               rope_theta=500000.0)
FLAVORS: dict[str, dict[str, Any]] = {
    "tiny": dict(_SHARED, dim=64, n_layers=4, n_heads=4, max_position_embeddings=2048),  # intermediate_size 256
    "small": dict(_SHARED, dim=128, n_layers=6, n_heads=4, max_position_embeddings=4096),  # intermediate_size 512
    # for memory and bandwidth measurements, where the tiny ones are lost in noise; intermediate_size 1536
    "medium": dict(_SHARED, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, max_position_embeddings=4096),
}
# Expected parameter-count ranges (checked by the tests).
FLAVOR_PARAM_RANGES = {"tiny": (250_000, 400_000), "small": (1_200_000, 1_800_000), "medium": (20_000_000, 30_000_000)}

BUILD_RECORD = "flux_build.json"
BUILD_FORMAT = 1
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _maybe_apply_patches() -> None:
    try:
        from torchtitan_flux.patches import apply_patches  # type: ignore[attr-defined]
    except ImportError:
        return
    apply_patches()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (the alphabet of ByteLevel BPE)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # unique: ranks may build concurrently
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def build_tokenizer(out_dir: str | os.PathLike, model_max_length: int = 2048) -> Path:
    """Write a byte-level tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``).

    Ids: ``<|pad|>``=0, ``<|bos|>``=1, ``<|eos|>``=2, then byte ``b`` -> ``3 + b``. A BPE model without
    merges over the 256 ByteLevel symbols, so every byte of the input (every ASCII character) is one
    token. Loadable by ``torchtitan.components.tokenizer.HuggingFaceTokenizer(tokenizer_path=out_dir)`` and by
    ``transformers.PreTrainedTokenizerFast.from_pretrained(out_dir)``. No BOS/EOS is added by the
    tokenizer.json itself; ``add_bos_token: true`` in the config makes torchtitan's ``encode`` prepend BOS
    by default (``encode(text, add_bos=..., add_eos=...)`` controls it explicitly).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in _bytes_to_unicode().items():
        vocab[ch] = BYTE_OFFSET + b
    assert len(vocab) == VOCAB_SIZE

    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)
         for t in SPECIAL_TOKENS]
    )
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tmp = out / f".tokenizer.json.{os.getpid()}.tmp"
    tok.save(str(tmp))
    os.replace(tmp, out / "tokenizer.json")

    def _added(t: str) -> dict[str, Any]:
        return {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }

    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(i): _added(t) for i, t in enumerate(SPECIAL_TOKENS)},
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": int(model_max_length),
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN},
    )
    return out


def flavor_hf_config(flavor: str) -> dict[str, Any]:
    """The HF ``LlamaConfig`` fields (``config.json``) of a flavor (imports torchtitan)."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; known: {sorted(FLAVORS)}")
    _maybe_apply_patches()
    from torchtitan.models.common import compute_ffn_hidden_dim

    f = FLAVORS[flavor]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": f["dim"],
        "intermediate_size": compute_ffn_hidden_dim(f["dim"], multiple_of=f["multiple_of"],
                                                    ffn_dim_multiplier=f["ffn_dim_multiplier"]),
        "num_hidden_layers": f["n_layers"],
        "num_attention_heads": f["n_heads"],
        "num_key_value_heads": f["n_kv_heads"],
        "head_dim": f["dim"] // f["n_heads"],
        "vocab_size": f["vocab_size"],
        "rms_norm_eps": f["norm_eps"],
        "rope_theta": float(f["rope_theta"]),
        "rope_scaling": dict(ROPE_SCALING),
        "max_position_embeddings": f["max_position_embeddings"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
    }


def build_torchtitan_model(flavor: str = "tiny", seed: int = 0):
    """(model, model config): the trainer's model of ``flavor`` (torchtitan's ``Llama3Model``), fp32,
    ``init_weights()`` seeded."""
    import torch

    from torchtitan_flux.models import families

    config = families.model_config(flavor_hf_config(flavor), f"flavor {flavor}")
    torch.manual_seed(seed)
    model = config.build()
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.float(), config


def _is_built(out: Path, flavor: str, seed: int) -> bool:
    rec = out / BUILD_RECORD
    if not rec.is_file():
        return False
    try:
        with open(rec) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    if data != {"flavor": flavor, "seed": int(seed), "format": BUILD_FORMAT}:
        return False
    needed = ("config.json", WEIGHTS_FILE) + TOKENIZER_FILES
    return all((out / n).is_file() for n in needed)


def build_model_dir(out_dir: str | os.PathLike, flavor: str = "tiny", seed: int = 0) -> Path:
    """Build (or reuse) a HF-layout Llama model folder of ``flavor`` with weights from ``seed``.

    Idempotent: if ``out_dir/flux_build.json`` records the same flavor and seed and all files exist,
    nothing is written. Otherwise everything is (re)written; ``flux_build.json`` is written last, so an
    interrupted build is redone.
    """
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; known: {sorted(FLAVORS)}")
    out = Path(out_dir)
    if _is_built(out, flavor, seed):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:  # concurrent builders (test workers, CI stages):
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builds, the others then find it built
        if not _is_built(out, flavor, seed):
            _build(out, flavor, seed)
    return out


def _build(out: Path, flavor: str, seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / BUILD_RECORD).unlink(missing_ok=True)

    from safetensors.torch import save_file

    from torchtitan_flux.models import families

    model, config = build_torchtitan_model(flavor, seed)
    max_pos = FLAVORS[flavor]["max_position_embeddings"]
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf_sd = families.state_dict_adapter(config).to_hf(sd)
    hf_sd = {k: v.contiguous() for k, v in hf_sd.items()}

    build_tokenizer(out, model_max_length=max_pos)
    _write_json(out / "config.json", flavor_hf_config(flavor))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": True},
    )
    fd, tmp = tempfile.mkstemp(dir=out, suffix=".safetensors.tmp")
    os.close(fd)
    save_file(hf_sd, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / WEIGHTS_FILE)
    (out / "model.safetensors.index.json").unlink(missing_ok=True)  # see module docstring
    _write_json(out / BUILD_RECORD, {"flavor": flavor, "seed": int(seed), "format": BUILD_FORMAT})


def count_parameters(model_dir: str | os.PathLike) -> int:
    """Number of parameters stored in a model folder's safetensors files."""
    from safetensors import safe_open

    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    total = 0
    for fpath in files:
        with safe_open(str(fpath), framework="pt") as f:
            for k in f.keys():
                n = 1
                for s in f.get_slice(k).get_shape():
                    n *= s
                total += n
    return total


def build_chat_model_dir(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """``model_dir`` (a tiny model folder) copied to ``out_dir`` as its chat variant, for multi-turn episodes:
    ``chat_template.jinja`` (``TINY_CHAT_TEMPLATE``) and ``CHAT_STOP_IDS`` as ``eos_token_id`` (the ids the engine
    and the episodes stop a turn on). Rewritten every call (a copy of a ~1 MB folder), replaced in one rename."""
    import shutil

    src, out = Path(model_dir), Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    shutil.copytree(src, tmp, dirs_exist_ok=True)
    (tmp / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)
    for name in ("config.json", "generation_config.json"):
        with open(tmp / name) as f:
            cfg = json.load(f)
        _write_json(tmp / name, {**cfg, "eos_token_id": CHAT_STOP_IDS})
    os.chmod(tmp, 0o755)
    with open(out.parent / f".{out.name}.lock", "w") as lock:  # concurrent builders: one rename at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    return out
