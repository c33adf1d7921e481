"""End-to-end (torchrun, embedded CPU engine, the debug config with a longer ``training.seq_len``): a reasoning-gym
task trains, is evaluated on its held-out set, and a resumed run draws the prompts of the uninterrupted one
(issue 47)."""

from __future__ import annotations

import json

import pytest
from _procs import start_step_of
from conftest import DEBUG_TOML, run_train

from torchtitan_flux.data.tasks import build_task, prompt_tokenizer
from torchtitan_flux.patches import apply_patches

apply_patches()


from torchtitan_flux.run.config_file import load_config
from torchtitan_flux.run.trainer import GRPOTrainer  # noqa: E402

EASY = ["min_terms=2", "max_terms=2", "max_digits=1", 'operators=["+"]', "allow_parentheses=false",
        "allow_negation=false"]


def table(dump) -> dict[int, list[tuple[str, str, float]]]:
    out: dict[int, list] = {}
    for x in (dump / "completions.jsonl").read_text().splitlines():
        r = json.loads(x)
        out.setdefault(r["step"], []).append((r["prompt"], r["completion"], r["reward"]))
    return out


@pytest.mark.slow
def test_a_reasoning_gym_task_trains_evaluates_and_resumes_its_draw(tiny_model_dir, tmp_path):
    args = ["--rollout.task", "reasoning_gym:basic_arithmetic", "--rollout.task_args",
            ",".join([*EASY, "system_prompt=direct"]), "--training.seq_len", "192", "--rollout.prompts_per_step", "2",
            "--eval.at_start", "true", "--eval.every_steps", "2", "--eval.num_prompts", "4",
            "--metrics.log_completions_every", "1", "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    run_train(tmp_path / "full", *args, "--training.steps", "4", timeout=400)
    run_train(tmp_path / "cut", *args, "--training.steps", "2", timeout=400)
    out = run_train(tmp_path / "cut", *args, "--training.steps", "4", timeout=400)
    out = out.stdout + out.stderr
    assert start_step_of(out) == 3 and "draw differs" not in out
    full, cut = table(tmp_path / "full"), table(tmp_path / "cut")
    assert sorted(full) == sorted(cut) == [1, 2, 3, 4]
    for step in (3, 4):
        assert cut[step] == full[step], step
    # the prompts are the task's draw, never a held-out question; every reward is score_answer's (0 .. 1)
    config = load_config(["--job.config_file", str(DEBUG_TOML), *args], GRPOTrainer.Config())
    config.hf_assets_path = str(tiny_model_dir)
    task = build_task(config, prompt_tokenizer(config))
    held_out = {p.text for p in task.eval_prompts(0, 4)}
    for step in (1, 2, 3, 4):
        drawn = {p.text for p in task.prompts(0, step, 2)}
        assert {p for p, _, _ in full[step]} == drawn and not drawn & held_out, step
        assert all(0.0 <= r <= 1.0 for _, _, r in full[step])
    evals = [json.loads(x) for x in (tmp_path / "full" / "eval.jsonl").read_text().splitlines()]
    assert [e["eval/version"] for e in evals] == [0, 2, 4]
    assert all(e["eval/num_prompts"] == 4 and "eval/rewards/score_answer/mean" in e for e in evals)
