"""``benchmarks/streaming.py`` and its workload (``benchmarks/workloads.py: heavy_tail``): the lengths are
heavy-tailed, clipped and a pure function of (seed, step), the reward needs the whole answer, the factory builds
what a run imports by name; the report reads the runs' files (token-level gaps and generated completions where the
trainer writes them, nan before) into key=value lines; ``--quick`` end to end (slow). Its one-line argument errors:
``test_bench_scripts.py``."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import ROOT
from fakes.stub_tokenizers import ByteTokenizer

from benchmarks.workloads import HeavyTailTask, digit_ids, heavy_tail, length_digits_reward, pareto_length, target_of
from torchtitan_flux.data.rewards import RewardScorer, reward_inputs
from torchtitan_flux.data.tasks import check_prompts

sys.path.insert(0, str(ROOT / "benchmarks"))
import streaming  # noqa: E402

DIGITS = digit_ids(ByteTokenizer())
KEYVAL = re.compile(r"^([a-z_0-9]+)=(\S+)$")  # what scripts/bench_quick.sh reads


def test_lengths_are_heavy_tailed_clipped_and_a_pure_function_of_seed_and_step():
    t = HeavyTailTask(96, DIGITS)
    lengths = [L for step in range(1, 301) for L in t.lengths(0, step, 4)]
    p50, p90 = statistics.median(lengths), statistics.quantiles(lengths, n=10)[8]
    assert 4 <= min(lengths) and max(lengths) == 96  # a few clipped at the budget
    assert p50 <= 10 and p90 / p50 >= 3, (p50, p90)  # most short, a few long
    assert sum(L == 96 for L in lengths) / len(lengths) < 0.1
    assert t.prompts(3, 7, 4) == t.prompts(3, 7, 4)
    assert t.lengths(3, 7, 16) != t.lengths(4, 7, 16) and t.lengths(3, 7, 16) != t.lengths(3, 8, 16)
    assert [p.max_new_tokens for p in t.prompts(3, 7, 4)] == t.lengths(3, 7, 4)  # the budget is the target
    assert check_prompts("heavy_tail", t.prompts(3, 7, 4), 4, 96)
    assert all(pareto_length(r, 2, 5, 0.5) in range(2, 6) for r in [__import__("random").Random(i) for i in range(50)])


def test_the_reward_needs_the_whole_answer_and_ignores_what_comes_after():
    t = HeavyTailTask(96, DIGITS)
    p = next(p for step in range(1, 50) for p in t.prompts(0, step, 4) if p.max_new_tokens == 8)
    assert target_of(p.text) == 8
    tok = ByteTokenizer()
    texts = ["12345678", "1234", "1234abcd", "12345678xyz", "", "1234567"]
    ids = [tok.encode(x, add_bos=False) for x in texts]
    prompts, completions, columns = reward_inputs(t, [p], texts, len(texts))
    got = RewardScorer(t.reward_funcs).score(prompts, completions, ids, columns).total
    assert got == [1.0, 0.5, 0.5, 1.0, 0.0, 7 / 8]
    assert length_digits_reward(None, [ids[0]] * 2, [8, 16], [sorted(DIGITS)] * 2) == [1.0, 0.5]


def test_the_factory_builds_plain_and_chat_prompts(tmp_path):
    cfg = SimpleNamespace(rollout=SimpleNamespace(max_new_tokens=32, apply_chat_template=False),
                          hf_assets_path=str(tmp_path))
    plain = heavy_tail(cfg, ByteTokenizer(), "", "", "rollout.task")
    assert plain.max_len == 32 and re.fullmatch(r"[a-z]{3,8} \d+:", plain.prompts(0, 1, 1)[0].text)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"}))
    cfg.rollout.apply_chat_template = True
    chat = heavy_tail(cfg, ByteTokenizer(), "", "", "rollout.task")
    p = chat.prompts(0, 1, 1)[0]
    assert p.text.startswith("<user>Write exactly ") and p.text.endswith("<assistant>") and not p.add_bos
    assert target_of(p.text) == p.max_new_tokens == plain.prompts(0, 1, 1)[0].max_new_tokens
    from torchtitan_flux.user_code import import_spec

    assert import_spec("rollout.task", "benchmarks.workloads:heavy_tail") is heavy_tail  # as a run imports it


def _run(tmp_path, mode: str, seed: int, rewards: list[float], *, tokens: bool = False, generated: bool = False,
         targets: tuple[int, ...] = (8, 40)) -> streaming.Run:
    rows = []
    for i, r in enumerate(rewards):
        row = {"step": i + 1, "time": 100.0 + i, "step_time_s": 1.0, "reward_mean": r, "version_gap_mean": 0.5,
               "completion_len_mean": 20.0, "train_time_s": 0.4, "gen_time_s": 0.5, "weight_sync_s": 0.01}
        if tokens:
            row |= {"token_version_gap_mean": 0.25, "token_version_gap_max": 1 + i % 2}
        if generated:
            row |= {"generated_completion_len_mean": 30.0, "generated_reward_mean": r / 2}
        rows.append(row)
    run_dir = tmp_path / mode / f"seed{seed}"
    run_dir.mkdir(parents=True)
    with open(run_dir / "completions.jsonl", "w") as f:
        for L in targets:
            f.write(json.dumps({"step": 1, "prompt": f"abc {L}:", "completion": "1", "reward": 0.1}) + "\n")
    return streaming.Run(mode, seed, rows, {"steps_per_s": 2.0 if mode == "async" else 3.0}, str(run_dir))


def _keyvals(lines: list[str]) -> dict[str, str]:
    got = dict(m.groups() for line in lines if (m := KEYVAL.match(line)))
    assert all(v == "nan" or math.isfinite(float(v)) for v in got.values()), got
    return got


def test_the_report_before_the_trainer_side_lands_prints_nan_for_what_it_cannot_read(tmp_path):
    runs = {"async": [_run(tmp_path, "async", s, [0.1, 0.5, 0.9]) for s in range(2)],
            "streaming": [_run(tmp_path, "streaming", s, [0.1, 0.6, 0.95], targets=(8, 8)) for s in range(2)]}
    text, lines = streaming.report(runs, [[8, 8, 8, 40], [8, 8, 8, 8]], 0.5)
    kv = _keyvals(lines)
    assert kv["streaming_speedup_heavy_tail"] == "1.500" and kv["streaming_reward_in_spread"] == "1"
    assert kv["token_version_gap_mean"] == kv["token_version_gap_max"] == "nan"
    assert kv["sample_version_gap_mean"] == "0.500" and kv["pair_efficiency"] == "0.50"
    assert kv["short_bias_streaming"] == f"{8 / 12:.3f}"  # trained 8 against a dispatched mean of 12
    assert kv["streaming_generated_len_mean"] == "nan" and kv["streaming_trained_len_mean"] == "20.00"
    assert kv["longest_over_mean_length"] == f"{24 / 12:.3f}" and "overlap_limit_at_pair_efficiency" in kv
    assert "streaming_speedup_real" not in kv and any(x.startswith("WARNING: pair efficiency") for x in lines)
    assert sum(x.startswith("NOTE:") for x in text) == 2
    bias = text[next(i for i, x in enumerate(text) if x.startswith("short bias")):]
    async_row = next(x for x in bias if x.startswith("async "))
    assert async_row.split()[1:] == ["24.0", "20.0", "20.0", "0.500", "0.500"]  # async trains what it generates


def test_the_report_reads_token_gaps_generated_completions_and_time_to_target(tmp_path):
    runs = {"async": [_run(tmp_path, "async", 0, [0.2, 0.4, 0.6])],
            "streaming_drop": [_run(tmp_path, "streaming_drop", 0, [0.1, 0.3, 0.5], tokens=True, generated=True)]}
    text, lines = streaming.report(runs, [[8, 40]], 0.95, target=0.25)
    kv = _keyvals(lines)
    assert kv["token_version_gap_mean"] == "0.250" and kv["token_version_gap_max"] == "2"
    assert kv["streaming_drop_generated_len_mean"] == "30.00" and kv["streaming_drop_generated_reward_mean"] == "0.150"
    assert kv["streaming_reward_in_spread"] == "0" and not any(x.startswith("NOTE:") for x in text)
    # from the start of step 1, async's trailing mean reaches 0.25 at step 2 (2 s), streaming's at step 3 (3 s)
    assert kv["streaming_speedup_real"] == f"{2 / 3:.3f}" and not any(x.startswith("WARNING") for x in lines)


@pytest.mark.slow
def test_quick_runs_end_to_end_and_prints_its_key_lines(tmp_path):
    p = subprocess.run([sys.executable, "benchmarks/streaming.py", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    kv = _keyvals(p.stdout.splitlines())
    for key in ("streaming_speedup_heavy_tail", "streaming_reward_in_spread", "token_version_gap_mean",
                "token_version_gap_max", "sample_version_gap_mean", "pair_efficiency"):
        assert key in kv, p.stdout
    assert kv["short_bias_streaming"] != "nan"  # the trained prompts were read from completions.jsonl
