"""TRL side of ``benchmarks/vs_trl.py``: runs Hugging Face TRL's ``GRPOTrainer`` on a local HF Llama folder.

Runs in ``.venv-trl`` (``scripts/setup_trl.sh``), never in the main venv, and imports nothing of torchtitan_flux
except, for ``--check-model``, the torch-only ``torchtitan_flux.models.inference`` and ``.weight_dict`` (imported from
the repository root: the package is not installed there).

  .venv-trl/bin/python benchmarks/trl_runner.py --check-model DIR
      load DIR in transformers (LlamaForCausalLM + PreTrainedTokenizerFast), check the tokenizer's ids and that
      HF's logits equal torchtitan_flux.models.inference.forward_logits / score on the same weights; prints
      ``max_abs_logit_diff=...`` and exits 1 if it exceeds 1e-4.
  .venv-trl/bin/python benchmarks/trl_runner.py --spec spec.json
      one GRPO run; spec keys: model_dir, prompts (list of step prompt lists, step 1 first), group_size,
      max_new_tokens, lr, beta1, beta2, eps, weight_decay, max_norm, seed, threads, out (JSONL path),
      attn_implementation ("sdpa" | "eager"), cache_implementation (null | "static" | ...), and for the real
      workload task = "capitals" with each prompt a dict {text, answer, ids} (ids: our engine's prompt ids,
      checked against TRL's tokenization of the text).

Output JSONL (one object per optimizer step): step, reward_mean, reward_std, time_s (wall clock since the first
step's start, as measured by a TrainerCallback at on_step_begin of step 1), step_time_s, samples_per_s,
completion_len_mean; the first line is {"event": "start", "startup_s": seconds from this interpreter's first statement to the
first step's start (imports, model load, trainer construction), "start_epoch": time.time() then}.

Reward: the digits task, same semantics as torchtitan_flux.data.tasks.DigitsTask.reward: the completion's tokens
(up to and including EOS) decoded with special tokens skipped; fraction of its characters that are digits;
an empty completion scores 0. The real workload (task "capitals", the model's own tokenizer and chat template, the
prompts already rendered by our ChatTemplate): ``examples/capital_rewards.py``'s ``capital_reward``, the function
our run uses, on the completions decoded with special tokens skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_PROCESS = time.perf_counter()
_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)


def digits_reward_text(text: str) -> float:
    return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def _our_inference():
    """``torchtitan_flux.models.inference`` and ``.weight_dict`` from this checkout: torch-only modules (they import
    nothing of torchtitan), imported from the repository root because .venv-trl does not install the package."""
    if _REPO not in sys.path:
        sys.path.insert(0, _REPO)
    from torchtitan_flux.models import inference
    from torchtitan_flux.models import weight_dict

    return inference, weight_dict


def expected_prompt_ids(text: str) -> list[int]:
    """Our engine's prompt ids: BOS then one token per UTF-8 byte (byte b -> 3 + b)."""
    return [1] + [3 + b for b in text.encode("utf-8")]


def load_tokenizer(model_dir: str):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    assert tok.pad_token_id == 0 and tok.bos_token_id == 1 and tok.eos_token_id == 2, (
        tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    return tok


def prompt_text_for_hf(tok, text: str) -> str:
    """The prompt string that HF tokenizes to exactly our engine's ids (BOS + bytes): transformers may or may not
    honour ``add_bos_token`` of tokenizer_config.json for a PreTrainedTokenizerFast, so check and prepend the BOS
    token's text when it does not."""
    ids = tok(text)["input_ids"]
    want = expected_prompt_ids(text)
    if ids == want:
        return text
    if ids == want[1:]:
        with_bos = tok.bos_token + text
        assert tok(with_bos)["input_ids"] == want, (tok(with_bos)["input_ids"], want)
        return with_bos
    raise AssertionError(f"HF tokenizer gives {ids} for {text!r}; our engine uses {want}")


# ------------------------------------------------------------------------------------------- model check


def check_model(model_dir: str, tol: float = 1e-4) -> int:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    inf, weight_dict = _our_inference()
    tok = load_tokenizer(model_dir)
    text = "hello world: 0123"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert tok.decode([1, 3 + ord("a"), 2], skip_special_tokens=True) == "a"
    prompt_text_for_hf(tok, "abc:")

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    weights, shape = weight_dict.load_hf_weights_dict(model_dir)
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    worst_lp = 0.0
    for B, L in ((1, 8), (4, 40), (2, 150)):
        ids = torch.randint(3, shape.vocab_size, (B, L), generator=g)
        ids[:, 0] = 1
        with torch.no_grad():
            hf = model(input_ids=ids).logits.float()
            ours = inf.forward_logits(weights, shape, ids)
            hf_lp = torch.log_softmax(hf[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            our_lp = inf.score(weights, shape, ids)
        worst = max(worst, (hf - ours).abs().max().item())
        worst_lp = max(worst_lp, (hf_lp - our_lp).abs().max().item())
    ok = worst <= tol and worst_lp <= tol
    print(f"model_dir={model_dir} params={n_params} transformers_class={type(model).__name__} "
          f"max_abs_logit_diff={worst:.3e} max_abs_logprob_diff={worst_lp:.3e} {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------- GRPO run


def run(spec: dict) -> None:
    threads = int(spec.get("threads", 2))
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import LlamaForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_dir = spec["model_dir"]
    G = int(spec["group_size"])
    steps_prompts: list[list] = spec["prompts"]
    n_steps = len(steps_prompts)
    P = len(steps_prompts[0])
    real = spec.get("task") == "capitals"
    # Prompts in step order; shuffle_dataset=False makes TRL's RepeatSampler walk them in this order, P per step.
    if real:
        from transformers import AutoTokenizer

        if _REPO not in sys.path:
            sys.path.insert(0, _REPO)
        from examples.capital_rewards import capital_reward

        tok = AutoTokenizer.from_pretrained(model_dir)
        flat = [p["text"] for ps in steps_prompts for p in ps]
        for p in (p for ps in steps_prompts for p in ps):  # TRL tokenizes a text prompt with tok(text=...)
            ids = tok(text=[p["text"]])["input_ids"][0]
            assert list(ids) == p["ids"], f"TRL's prompt ids {ids} differ from our engine's {p['ids']}"
        dataset = Dataset.from_dict({"prompt": flat, "answer": [p["answer"] for ps in steps_prompts for p in ps]})
    else:
        tok = load_tokenizer(model_dir)
        flat = [prompt_text_for_hf(tok, p) for ps in steps_prompts for p in ps]
        dataset = Dataset.from_dict({"prompt": flat})

    model = LlamaForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=spec.get("attn_implementation", "sdpa"))

    out_path = spec["out"]
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fout = open(out_path, "w", buffering=1)
    state = {"t0": None, "prev": None, "rewards": [], "lens": []}

    def digits_reward(prompts, completions, completion_ids, **kwargs):
        # decode ourselves (skip special tokens) so the semantics do not depend on TRL's text post-processing
        texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
        r = capital_reward(texts, kwargs["answer"]) if real else [digits_reward_text(t) for t in texts]
        state["rewards"].append(r)
        state["lens"].append([len(c) for c in completion_ids])
        return r

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            if state["t0"] is None:
                state["t0"] = state["prev"] = time.perf_counter()
                fout.write(json.dumps({"event": "start", "startup_s": state["t0"] - T_PROCESS,
                                       "start_epoch": time.time()}) + "\n")

        def on_step_end(self, args, st, control, **kw):
            now = time.perf_counter()
            r = state["rewards"][-1]
            lens = state["lens"][-1]
            mean = sum(r) / len(r)
            dt = now - state["prev"]
            state["prev"] = now
            fout.write(json.dumps({
                "step": st.global_step, "reward_mean": mean,
                "reward_std": (sum((x - mean) ** 2 for x in r) / len(r)) ** 0.5,
                "time_s": now - state["t0"], "step_time_s": dt, "samples_per_s": len(r) / max(dt, 1e-9),
                "completion_len_mean": sum(lens) / len(lens),
            }) + "\n")

    gen_kwargs = {}
    cache_impl = spec.get("cache_implementation")
    cfg = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(os.path.abspath(out_path)), "trl_tmp"),
        # hardware / precision: fp32 on CPU, as ours
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, torch_compile=False,
        # batch: one optimizer step per generation batch of P prompts x G completions
        per_device_train_batch_size=P * G, gradient_accumulation_steps=1, num_generations=G,
        steps_per_generation=1, num_iterations=1, max_steps=n_steps, shuffle_dataset=False,
        max_completion_length=int(spec["max_new_tokens"]),
        # sampling: plain temperature-1 sampling over the full vocabulary (as our engines)
        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        cache_implementation=cache_impl, generation_kwargs=gen_kwargs or None,
        # objective: GRPO, token-level normalisation over the batch (ours: loss_normalization="token"),
        # group-std-scaled advantages, clip 0.2 / 0.28, no KL (no reference model)
        loss_type="dapo", scale_rewards="group", beta=0.0, epsilon=0.2, epsilon_high=0.28,
        mask_truncated_completions=False, disable_dropout=True,
        # optimizer: torch AdamW, constant LR, no warmup, clip 1.0 (ours: torchtitan AdamW "foreach", same values)
        optim="adamw_torch", learning_rate=float(spec["lr"]), adam_beta1=float(spec["beta1"]),
        adam_beta2=float(spec["beta2"]), adam_epsilon=float(spec["eps"]),
        weight_decay=float(spec["weight_decay"]), max_grad_norm=float(spec["max_norm"]),
        lr_scheduler_type="constant", warmup_steps=0,
        # no I/O in the loop
        logging_steps=10**9, save_strategy="no", report_to="none", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0, seed=int(spec["seed"]), data_seed=int(spec["seed"]),
    )
    trainer = GRPOTrainer(model=model, reward_funcs=digits_reward, args=cfg, train_dataset=dataset,
                          processing_class=tok, callbacks=[StepTimer()])
    trainer.train()
    fout.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--check-model", metavar="DIR", help="HF-vs-ours logits equivalence check of a model folder")
    g.add_argument("--spec", help="JSON run spec (see the module docstring)")
    args = ap.parse_args(argv)
    if args.check_model:
        return check_model(args.check_model)
    with open(args.spec) as f:
        run(json.load(f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
