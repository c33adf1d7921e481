"""Tiny model assets, HF weight I/O, the llama model config of a folder and the torch-only KV-cache inference.

The torch-only forward (``torchtitan_flux.models.inference``) is checked against torchtitan's own
``Llama3Model`` loaded from the same folder.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import torch

# torchtitan's models import triton at import time; the patches make them importable on CPU-only machines.
from torchtitan_flux.patches import apply_patches  # noqa: E402

apply_patches()

import model_assets as assets  # noqa: E402

from torchtitan_flux.models import inference

from torchtitan_flux.models import weight_dict
from torchtitan_flux.models.inference import forward_logits, generate, score  # noqa: E402
from torchtitan_flux.models.weight_dict import ModelShape  # noqa: E402
from torchtitan_flux.models.hf_weights import HFLayout, export_hf_weights, load_hf_weights  # noqa: E402
from torchtitan_flux.models import families  # noqa: E402

FLAVOR, SEED = "tiny", 0
EOS, PAD = assets.EOS_ID, assets.PAD_ID


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return assets.build_model_dir(tmp_path_factory.mktemp("flux_tiny"), flavor=FLAVOR, seed=SEED)


@pytest.fixture(scope="module")
def reference():
    """torchtitan model exactly as build_model_dir built it (before HF conversion), fp32 eval, and its config."""
    model, config = assets.build_torchtitan_model(FLAVOR, SEED)
    return model.eval(), config


@pytest.fixture(scope="module")
def engine(model_dir):
    weights, shape = weight_dict.load_hf_weights_dict(model_dir)
    return weights, shape


def _assert_pushed(weights: dict, sd: dict, config) -> None:
    """``weights`` (an engine's) are exactly the torchtitan state dict ``sd`` as pushed: HF names and layout."""
    layout = HFLayout(config)
    names = layout.hf_names(list(sd), [tuple(v.shape) for v in sd.values()])
    assert list(weights) == names
    for name, (k, v) in zip(names, sd.items()):
        assert torch.equal(weights[name], layout.wire_tensor(k, v)), name


def _tt_logprobs(model, batch: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(batch).float() / temperature, dim=-1)


# ------------------------------------------------------------------------------------------------
# assets
# ------------------------------------------------------------------------------------------------


def test_build_model_dir_files_idempotent_and_param_count(model_dir, tmp_path):
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             assets.BUILD_RECORD]
    for n in names:
        assert (model_dir / n).is_file(), n
    # an index naming "model.safetensors" would crash torchtitan's StateDictAdapter (no shard number)
    assert not (model_dir / "model.safetensors.index.json").exists()
    assert json.loads((model_dir / assets.BUILD_RECORD).read_text())["flavor"] == FLAVOR

    mtimes = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert assets.build_model_dir(model_dir, flavor=FLAVOR, seed=SEED) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == mtimes

    lo, hi = assets.FLAVOR_PARAM_RANGES[FLAVOR]
    n = assets.count_parameters(model_dir)
    assert lo <= n <= hi, n

    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 0)
    assert cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == 259

    # a different seed in the same folder rebuilds with different weights
    other = assets.build_model_dir(tmp_path / "m", flavor=FLAVOR, seed=SEED + 1)
    w0, _ = weight_dict.load_hf_weights_dict(model_dir)
    w1, _ = weight_dict.load_hf_weights_dict(other)
    assert not torch.equal(w0["model.layers.0.self_attn.q_proj.weight"], w1["model.layers.0.self_attn.q_proj.weight"])


def test_tokenizer_roundtrip_with_torchtitan(model_dir):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(tokenizer_path=str(model_dir))
    assert (tok.bos_id, tok.eos_id, tok.get_vocab_size()) == (1, 2, 259)
    text = "12 + 30 = 42\n"
    ids = tok.encode(text, add_bos=True, add_eos=False)
    assert ids == [1] + [assets.BYTE_OFFSET + b for b in text.encode()]
    assert tok.decode(ids) == text
    assert tok.encode(text, add_bos=False, add_eos=True) == ids[1:] + [2]
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<|bos|>", "<|eos|>", "<|pad|>")


# ------------------------------------------------------------------------------------------------
# model.py
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("intermediate", [256, 100, 1000, 1536])
def test_ffn_width_is_intermediate_size(model_dir, intermediate):
    """torchtitan 0.3.0 takes the FFN width as given: any ``intermediate_size`` (0.2.2 derived it from
    ``multiple_of`` / ``ffn_dim_multiplier``, which we had to solve for)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["intermediate_size"] = intermediate
    with torch.device("meta"):
        model = families.model_config(cfg).build()
    assert model.layers["0"].feed_forward.w1.weight.shape == (intermediate, cfg["hidden_size"])


def test_model_config_of_the_folder_loads_the_built_weights(model_dir, reference):
    ref_model, _ = reference
    config = families.config_from_hf_dir(model_dir, max_seq_len=64)
    assert isinstance(config, families.FluxLlamaModel.Config) and config.max_seq_len == 64
    assert not config.enable_weight_tying and config.layers[0].attention.head_dim == 16
    model = config.build()
    load_hf_weights(model, model_dir, config)
    ref_sd = ref_model.state_dict()
    sd = model.state_dict()
    assert sd.keys() == ref_sd.keys()
    for k, v in sd.items():
        assert torch.equal(v, ref_sd[k]), k


def test_load_hf_weights_errors(model_dir, tmp_path):
    config = families.config_from_hf_dir(model_dir, max_seq_len=32)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_weights(config.build(), tmp_path, config)
    cfg = json.loads((model_dir / "config.json").read_text())
    bad = families.model_config({**cfg, "vocab_size": 300}, max_seq_len=32)
    with pytest.raises(ValueError, match=r"embed_tokens.*\(259, 64\).*\(300, 64\)"):
        load_hf_weights(bad.build(), model_dir, bad)


def test_export_hf_weights_roundtrip(model_dir, tmp_path):
    config = families.config_from_hf_dir(model_dir, max_seq_len=32)
    model = config.build()
    load_hf_weights(model, model_dir, config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    src = tmp_path / "src"  # a folder whose chat template is its own file, as transformers 5 saves it
    shutil.copytree(model_dir, src)
    (src / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    out = export_hf_weights(model, tmp_path / "export", config, src)
    for n in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / n).is_file(), n
    fresh_config = families.config_from_hf_dir(out, max_seq_len=32)
    fresh = fresh_config.build()
    load_hf_weights(fresh, out, fresh_config)
    sd = model.state_dict()
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # the torch-only reader of the engines gives what a push of these parameters carries (HF names and layout)
    _assert_pushed(weight_dict.load_hf_weights_dict(out)[0], sd, config)


def test_load_and_export_with_fsdp2_dtensors(model_dir, reference, tmp_path):
    """Single-process gloo group: the model's parameters are FSDP2 DTensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        config = families.config_from_hf_dir(model_dir, max_seq_len=32)
        model = config.build()
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert isinstance(model.layers["0"].attention.qkv_linear.wq.weight, DTensor)
        load_hf_weights(model, model_dir, config)
        ref_sd = reference[0].state_dict()
        for k, v in model.state_dict().items():
            assert torch.equal(v.full_tensor(), ref_sd[k]), k
        out = export_hf_weights(model, tmp_path / "export", config, model_dir)
    finally:
        dist.destroy_process_group()
    _assert_pushed(weight_dict.load_hf_weights_dict(out)[0], ref_sd, config)


# ------------------------------------------------------------------------------------------------
# inference.py
# ------------------------------------------------------------------------------------------------


def test_inference_module_does_not_import_torchtitan():
    """inference.py imports no torchtitan, and of torchtitan_flux only weight_dict.py, which imports only the HF
    reader, which imports neither."""
    from torchtitan_flux.models import hf

    for module, allowed in ((inference, {"torchtitan_flux.models.weight_dict"}), (weight_dict, {"torchtitan_flux.models"}),
                            (hf, set())):
        tree = ast.parse(Path(module.__file__).read_text())
        mods = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                mods.add(node.module or "")
                if node.module == "torchtitan_flux.models":
                    assert [a.name for a in node.names] == ["hf"], node.names
        bad = {m for m in mods if m.split(".")[0] in ("torchtitan", "torchtitan_flux")} - allowed
        assert not bad, (module.__name__, bad)


def test_weight_names_and_shapes_are_what_a_push_of_torchtitans_model_carries(reference, engine, model_dir):
    ref_model, ref_config = reference
    weights, shape = engine
    assert shape == ModelShape.from_hf_dir(model_dir)
    sd = ref_model.state_dict()
    pushed = HFLayout(ref_config).hf_names(list(sd), [tuple(v.shape) for v in sd.values()])
    assert weight_dict.weight_names(shape) == pushed
    assert list(weight_dict.weight_shapes(shape).values()) == [tuple(v.shape) for v in sd.values()]
    _assert_pushed(weights, sd, ref_config)


@pytest.mark.parametrize(
    "rope_scaling",
    ["as_built", None, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}],
)
def test_rope_table_matches_torchtitan(model_dir, rope_scaling):
    cfg = json.loads((model_dir / "config.json").read_text())
    if rope_scaling != "as_built":
        cfg["rope_scaling"] = rope_scaling  # None: no scaling (factor 1)
    shape = ModelShape.from_hf_config(cfg)
    ref = families.model_config(cfg, max_seq_len=4096).layers[0].attention.rope.build().cache  # ComplexRoPE's
    assert torch.equal(inference.precompute_freqs_cis(shape, 4096), ref)
    # the cached table used by generate/score: positions do not depend on the table length
    for end in (10, 3000):
        table = inference._freqs_cis(shape, end, torch.device("cpu"))
        assert table.shape[0] >= end and torch.equal(table[:4096], ref[: table.shape[0]])


def test_score_matches_torchtitan(reference, engine):
    ref_model, _ = reference
    weights, shape = engine
    g = torch.Generator().manual_seed(0)
    lengths = [5, 17, 11, 2]
    L = max(lengths)
    batch = torch.full((len(lengths), L), PAD, dtype=torch.long)  # right-padded
    for b, n in enumerate(lengths):
        batch[b, :n] = torch.randint(3, 259, (n,), generator=g)
    for temperature in (1.0, 0.7):
        tt = _tt_logprobs(ref_model, batch, temperature)
        ref_lp = tt[:, :-1].gather(-1, batch[:, 1:, None]).squeeze(-1)
        ours = score(weights, shape, batch, temperature)
        assert ours.dtype == torch.float32 and ours.shape == (len(lengths), L - 1)
        for b, n in enumerate(lengths):
            # per-sequence scoring gives the same values as the padded batch
            alone = score(weights, shape, batch[b: b + 1, :n], temperature)[0]
            torch.testing.assert_close(alone, ours[b, : n - 1], atol=1e-5, rtol=0)
            diff = (ours[b, : n - 1] - ref_lp[b, : n - 1]).abs().max().item() if n > 1 else 0.0
            assert diff < 1e-5, (b, diff)
    full = forward_logits(weights, shape, batch)
    with torch.no_grad():
        torch.testing.assert_close(full, ref_model(batch).float(), atol=1e-5, rtol=0)


def _prompts(g, lens):
    return [[1] + torch.randint(3, 259, (n - 1,), generator=g).tolist() for n in lens]


def _rescore_with_torchtitan(ref_model, prompts, tokens, lengths, temperature):
    """Per-token logprobs of each completion (up to its length) under torchtitan, right-padded batch."""
    seqs = [p + tokens[b, : lengths[b]].tolist() for b, p in enumerate(prompts)]
    L = max(len(s) for s in seqs)
    batch = torch.full((len(seqs), L), PAD, dtype=torch.long)
    for b, s in enumerate(seqs):
        batch[b, : len(s)] = torch.tensor(s)
    lp = _tt_logprobs(ref_model, batch, temperature)
    out = []
    for b, p in enumerate(prompts):
        n = int(lengths[b])
        idx = torch.arange(len(p) - 1, len(p) - 1 + n)
        out.append((lp[b, idx], tokens[b, :n]))
    return out


def test_generate_kv_cache_matches_torchtitan(reference, engine):
    ref_model, _ = reference
    weights, shape = engine
    g = torch.Generator().manual_seed(1)
    base = _prompts(g, [3, 9, 1, 14, 6])
    prompts = base + base[:2]  # duplicated prompts (GRPO groups) share one prefill
    N, T = 12, 1.0
    tokens, logprobs, lengths = generate(
        weights, shape, prompts, max_new_tokens=N, temperature=T, eos_id=EOS, pad_id=PAD,
        generator=torch.Generator().manual_seed(123),
    )
    assert tokens.shape == (len(prompts), N) and tokens.dtype == torch.long
    assert logprobs.shape == (len(prompts), N) and logprobs.dtype == torch.float32
    assert lengths.dtype == torch.long and (lengths >= 1).all()
    max_diff = 0.0
    for b, (ref_lp_all, toks) in enumerate(
        _rescore_with_torchtitan(ref_model, prompts, tokens, lengths, T)
    ):
        ref_lp = ref_lp_all.gather(-1, toks[:, None]).squeeze(-1)
        max_diff = max(max_diff, (ref_lp - logprobs[b, : len(toks)]).abs().max().item())
    print(f"\nmax |logprob(generate) - logprob(torchtitan)| = {max_diff:.3e}")
    assert max_diff < 1e-4
    # same generator seed -> same samples; duplicated prompts were sampled independently
    again = generate(weights, shape, prompts, max_new_tokens=N, temperature=T, eos_id=EOS, pad_id=PAD,
                     generator=torch.Generator().manual_seed(123))
    assert torch.equal(again[0], tokens) and torch.equal(again[1], logprobs)
    assert not torch.equal(tokens[0], tokens[len(base)])


def test_generate_top_k_and_temperature(reference, engine):
    ref_model, _ = reference
    weights, shape = engine
    prompts = _prompts(torch.Generator().manual_seed(2), [4, 8, 2])
    T, K = 0.8, 5
    tokens, logprobs, lengths = generate(
        weights, shape, prompts, max_new_tokens=10, temperature=T, top_k=K, eos_id=EOS, pad_id=PAD,
        generator=torch.Generator().manual_seed(5),
    )
    for b, (ref_lp_all, toks) in enumerate(
        _rescore_with_torchtitan(ref_model, prompts, tokens, lengths, T)
    ):
        ranks = (ref_lp_all > ref_lp_all.gather(-1, toks[:, None])).sum(-1)
        assert (ranks < K).all(), ranks
        # logprobs are of the full (untruncated) tempered distribution
        torch.testing.assert_close(
            logprobs[b, : len(toks)], ref_lp_all.gather(-1, toks[:, None]).squeeze(-1), atol=1e-4, rtol=0
        )


def _naive_greedy(ref_model, prompt, n):
    seq = list(prompt)
    toks, lps = [], []
    for _ in range(n):
        lp = _tt_logprobs(ref_model, torch.tensor([seq]))[0, -1]
        t = int(lp.argmax())
        toks.append(t)
        lps.append(float(lp[t]))
        seq.append(t)
    return toks, lps


def test_greedy_matches_naive_loop_and_eos_handling(reference, engine):
    ref_model, _ = reference
    weights, shape = engine
    prompts = _prompts(torch.Generator().manual_seed(3), [2, 7, 12])
    N = 10
    # eos_id=-1 never matches: full-length greedy trajectories
    tokens, logprobs, lengths = generate(
        weights, shape, prompts, max_new_tokens=N, temperature=0.0, eos_id=-1, pad_id=PAD
    )
    assert (lengths == N).all()
    for b, p in enumerate(prompts):
        toks, lps = _naive_greedy(ref_model, p, N)
        assert tokens[b].tolist() == toks
        torch.testing.assert_close(logprobs[b], torch.tensor(lps), atol=1e-4, rtol=0)

    # pick an "eos" that rows emit at different steps (or never): each row stops right after its first one
    for eos in {int(tokens[0, 0]), int(tokens[1, 3]), int(tokens[2, N - 1])}:
        t2, lp2, len2 = generate(
            weights, shape, prompts, max_new_tokens=N, temperature=0.0, eos_id=eos, pad_id=PAD
        )
        for b in range(len(prompts)):
            row = tokens[b].tolist()
            n = row.index(eos) + 1 if eos in row else N
            assert int(len2[b]) == n
            assert t2[b, :n].tolist() == row[:n]
            torch.testing.assert_close(lp2[b, :n], logprobs[b, :n], atol=1e-5, rtol=0)
            assert (t2[b, n:] == PAD).all() and (lp2[b, n:] == 0).all()

    # eos forced by the weights: blocks add nothing to the residual (wo = w2 = 0), every embedding has
    # feature 0 equal to 1, and only eos reads feature 0 -> eos logit ~ +100, all others 0.
    forced = dict(weights)
    for i in range(shape.n_layers):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            forced[f"model.layers.{i}.{name}"] = torch.zeros_like(weights[f"model.layers.{i}.{name}"])
    emb = weights[weight_dict.EMBEDDING].clone()
    emb[:, 0] = 1.0
    forced[weight_dict.EMBEDDING] = emb
    out_w = torch.zeros_like(weights[weight_dict.LM_HEAD])
    out_w[EOS, 0] = 100.0
    forced[weight_dict.LM_HEAD] = out_w
    for temperature in (0.0, 1.0):
        t3, lp3, len3 = generate(
            forced, shape, prompts, max_new_tokens=N, temperature=temperature, eos_id=EOS, pad_id=PAD,
            generator=torch.Generator().manual_seed(0),
        )
        assert (len3 == 1).all() and (t3[:, 0] == EOS).all()
        assert (t3[:, 1:] == PAD).all() and (lp3[:, 1:] == 0).all()
        assert (lp3[:, 0] > -1e-6).all() and (lp3[:, 0] <= 0).all()
