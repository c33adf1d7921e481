"""Datasets (real HF ``datasets`` on local files of each format), chat templates, prompt-length handling, TRL-style
rewards, the GSM8K answer extractor and epoch sampling (issue 15). End-to-end runs are in test_data_e2e.py."""

from __future__ import annotations

import asyncio
import json
import math
import re
from types import SimpleNamespace

import pytest

from torchtitan_flux.data import rewards as R
from torchtitan_flux.data.datasets import ChatTemplate, EpochSampler
from torchtitan_flux.data.rewards import reward_inputs
from torchtitan_flux.data.tasks import Gsm8kTask, build_task

ROWS = [{"prompt": f"q{i}?", "answer": str(i), "level": i % 3} for i in range(10)]


class ByteTokenizer:
    def encode(self, text, add_bos=True, add_eos=False):
        return ([1] if add_bos else []) + list(text.encode())


def job(tmp_path, path, **rollout):
    r = dict(task="dataset", dataset_path=str(path), dataset_split="train", prompt_column="prompt",
             messages_column="messages", answer_column="answer", apply_chat_template=False, max_prompt_tokens=0,
             long_prompts="drop", reward_funcs=["test_data:exact"], reward_weights=[], seed=0,
             max_new_tokens=8, task_timeout_seconds=60.0, environment="")
    r.update(rollout)
    return SimpleNamespace(rollout=SimpleNamespace(**r), training=SimpleNamespace(seq_len=64),
                           hf_assets_path=str(tmp_path / "model"),
                           eval=SimpleNamespace(every_steps=0, at_start=False))


def exact(completions, answer, **kwargs):  # a reward in TRL's documented style
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]


def write(tmp_path, fmt: str):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    if fmt == "jsonl":
        p = tmp_path / "d.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "json":
        p = tmp_path / "d.json"
        p.write_text(json.dumps(ROWS))
    elif fmt == "parquet":
        p = tmp_path / "d.parquet"
        ds.to_parquet(str(p))
    elif fmt == "csv":
        p = tmp_path / "d.csv"
        ds.to_csv(str(p), index=False)
    elif fmt == "save_to_disk":
        p = tmp_path / "saved"
        ds.save_to_disk(str(p))
    elif fmt == "save_to_disk_dict":
        p = tmp_path / "saved_dict"
        datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(p))
    elif fmt == "folder":
        p = tmp_path / "folder"
        p.mkdir()
        (p / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
        (p / "test.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    return p


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "save_to_disk", "save_to_disk_dict", "folder"])
def test_every_format_loads_through_datasets(tmp_path, fmt):
    path = write(tmp_path, fmt)
    task = build_task(job(tmp_path, path), ByteTokenizer())
    assert sorted(p.text for p in task.records) == sorted(r["prompt"] for r in ROWS)
    p = next(p for p in task.records if p.text == "q4?")
    assert p.answer == "4" and int(p.columns["level"]) == 1  # every other column reaches the reward (csv: as read)
    prompts, completions, columns = reward_inputs(task, [p], ["4", "5"], 2)
    assert task.reward_funcs[0].fn(prompts=prompts, completions=completions, **columns) == [1.0, 0.0]
    if fmt in ("save_to_disk_dict", "folder"):  # the held-out split of the same folder
        test = build_task(job(tmp_path, path), ByteTokenizer(), dataset_split="test")
        assert len(test.records) == (2 if fmt == "save_to_disk_dict" else 1)


def test_missing_columns_and_splits_name_the_field(tmp_path):
    path = write(tmp_path, "folder")
    with pytest.raises(ValueError, match="split 'validation' is not in rollout.dataset_path"):
        build_task(job(tmp_path, path, dataset_split="validation"), ByteTokenizer())
    with pytest.raises(ValueError, match="rollout.prompt_column"):
        build_task(job(tmp_path, path, prompt_column="question"), ByteTokenizer())
    bad = tmp_path / "d.txt"
    bad.write_text("x")
    with pytest.raises(ValueError, match="unknown file type"):
        build_task(job(tmp_path, bad), ByteTokenizer())


def test_gsm8k_task_reads_question_and_scores_the_final_answer(tmp_path):
    p = tmp_path / "g.jsonl"
    p.write_text(json.dumps({"question": "2+2?", "answer": "2 + 2 = 4.\n#### 4"}) + "\n")
    task = build_task(job(tmp_path, p, task="gsm8k", reward_funcs=[]), ByteTokenizer())
    assert isinstance(task, Gsm8kTask) and task.records[0].text == "2+2?"
    prompts, comps, cols = reward_inputs(task, task.records, ["so 3 then 4", "4 or 5", ""], 3)
    assert task.reward_funcs[0].fn(prompts=prompts, completions=comps, **cols) == [1.0, 0.0, 0.0]


def test_gsm8k_records_without_a_comparable_answer_are_named(tmp_path, caplog):
    """Before 2026-11-25 (issue 27): no answer column, or answers with no '####'/number, trained with reward 0 forever
    and no word. Now none: refused in one line; some: one warning with their count."""
    from torchtitan_flux.errors import ConfigError

    p = tmp_path / "g.jsonl"
    p.write_text("".join(json.dumps({"question": f"{i}+1?"}) + "\n" for i in range(3)))
    with pytest.raises(ConfigError, match=r"no record has an answer in column 'answer' \(rollout.answer_column\) that "
                                          r"answer_match can compare"):
        build_task(job(tmp_path, p, task="gsm8k", reward_funcs=[]), ByteTokenizer())
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?", "answer": "####"},
            {"question": "3+3?", "answer": ""}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING", logger="torchtitan_flux"):
        build_task(job(tmp_path, p, task="gsm8k", reward_funcs=[]), ByteTokenizer())
    assert "2 of 3 records (the first: record 1) have no answer in column 'answer'" in caplog.text


def test_shipped_synthetic_data_is_gsm8k_format():
    from conftest import ROOT

    rows = [json.loads(x) for x in (ROOT / "data" / "gsm8k_synthetic" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 2000 and all(re.search(r"\n#### \d+$", r["answer"]) for r in rows)
    for r in rows[:50]:
        a, b = map(int, re.search(r"(\d+) \+ (\d+) =", r["answer"]).groups())
        assert R.gold_answer(r["answer"]) == str(a + b)


# ------------------------------------------------------------------------------------------- chat template

CHATML = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def model_dir_with_template(tmp_path, template=CHATML):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return d


def test_messages_dataset_goes_through_the_model_folders_template(tmp_path):
    model_dir_with_template(tmp_path)
    p = tmp_path / "chat.jsonl"
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}]
    p.write_text(json.dumps({"messages": msgs, "answer": "2"}) + "\n")
    task = build_task(job(tmp_path, p), ByteTokenizer())
    rec = task.records[0]
    assert rec.text == "<s><|system|>be brief</s>\n<|user|>1+1?</s>\n<|assistant|>"
    assert rec.add_bos is False and task.chat  # the template wrote the BOS
    prompts, completions, _ = reward_inputs(task, [rec], ["2"], 1)  # TRL's conversational format
    assert prompts == [msgs] and completions == [[{"role": "assistant", "content": "2"}]]
    assert R.answer_match_reward(completions, ["2"]) == [1.0]


def test_apply_chat_template_wraps_text_prompts(tmp_path):
    model_dir_with_template(tmp_path)
    task = build_task(job(tmp_path, write(tmp_path, "jsonl"), apply_chat_template=True), ByteTokenizer())
    assert {p.text for p in task.records} >= {"<s><|user|>q3?</s>\n<|assistant|>"}
    assert not task.chat  # rewards still get plain text


def test_template_features_transformers_provides(tmp_path):
    """raise_exception, tojson, loopcontrols and trim_blocks behave as in transformers' renderer."""
    t = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
         "{% if loop.index > 1 %}{% break %}{% endif %}\n{{ m | tojson }}\n{% endfor %}")
    tpl = ChatTemplate(str(model_dir_with_template(tmp_path, t)))
    assert tpl.render([{"role": "user", "content": "é"}, {"role": "user", "content": "x"}]) == \
        '{"role": "user", "content": "é"}\n'
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="no tools"):
        tpl.render([{"role": "tool", "content": ""}])
    with pytest.raises(ValueError, match="no chat_template"):
        ChatTemplate(str(tmp_path))


# ------------------------------------------------------------------------------------------ bad records

@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank-lines"])
def test_an_empty_jsonl_file_is_one_line(tmp_path, text):
    """Before 2026-11-25 (issue 27): the datasets library's 'Instruction "train" corresponds to no data!'."""
    from torchtitan_flux.errors import ConfigError

    p = tmp_path / "d.jsonl"
    p.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(f"rollout.dataset_path = {str(p)!r} holds no records (it is "
                                                    "empty or only blank lines)")):
        build_task(job(tmp_path, p), ByteTokenizer())


@pytest.mark.parametrize("line, match", [
    (b'{"prompt": "caf\xe9?", "answer": "1"}', r"line 2: byte 0xe9 at column 16 is not UTF-8; allowed: UTF-8 text"),
    (b'{"prompt": "q?", "answer": 1', r"line 2: not valid JSON \(Expecting ',' delimiter at column 29\); allowed: "
                                    r"one JSON object per line"),
    (b'["q?", "1"]', r"line 2: a JSON list; allowed: one JSON object per line"),
    (b'{"prompt": "q \\ud800?", "answer": "1"}',  # before (issue 27's second sweep): the library's
     r"line 2: the escape '\\ud800' is half of a UTF-16 surrogate pair, not text; allowed: valid Unicode"),  # no line
    (b'{"prompt": "q?", "prompt": "r?", "answer": "1"}',  # before (issue 27's second sweep): "Trailing data at ..."
     r"line 2: key 'prompt' appears twice in one object; allowed: each key once"),
])
def test_a_bad_jsonl_line_names_the_file_and_line(tmp_path, line, match):
    """Before: bytes that are not UTF-8 were loaded without a word, and a syntax error named no line."""
    from torchtitan_flux.errors import ConfigError

    good = json.dumps(ROWS[0]).encode() + b"\n"
    p = tmp_path / "d.jsonl"
    p.write_bytes(good + line + b"\n" + good)
    with pytest.raises(ConfigError, match=re.escape(f"rollout.dataset_path = {str(p)!r} ") + match):
        build_task(job(tmp_path, p), ByteTokenizer())
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "train.jsonl").write_bytes(good + line + b"\n")
    with pytest.raises(ConfigError, match=re.escape(str(folder / "train.jsonl")) + ".* " + match):
        build_task(job(tmp_path, folder), ByteTokenizer())


def test_null_and_empty_prompts_are_refused_with_file_and_record(tmp_path):
    """Before: a null prompt was trained on as the text "None", an empty one as nothing."""
    from torchtitan_flux.errors import ConfigError

    p = tmp_path / "d.jsonl"
    rows = [ROWS[0], {"prompt": None, "answer": "1"}, ROWS[2], {"prompt": "", "answer": "3"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=re.escape(f"rollout.dataset_path = {str(p)!r} record 1: column 'prompt' is "
                                                    "None (2 of 4 records have a null, empty or blank prompt); allowed: a "
                                                    "non-empty prompt in every record")):
        build_task(job(tmp_path, p), ByteTokenizer())
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [], "answer": "1"}) + "\n")
    with pytest.raises(ConfigError, match=r"record 0: column 'messages' is \[\] \(1 of 1 records"):
        build_task(job(tmp_path, chat), ByteTokenizer())


@pytest.mark.parametrize("bad, match", [
    ({"prompt": "  \n\t ", "answer": "1"}, r"record 1: column 'prompt' is '  \\n\\t ' \(1 of 3 records have a null, "
                                             r"empty or blank prompt\)"),
    ({"prompt": 17, "answer": "1"}, r"record 1: column 'prompt' is int '17' \(1 of 3 records are not text\); allowed: a "
                                    r"string prompt in every record"),
    ({"prompt": ["a", "b"], "answer": "1"}, r"record 1: column 'prompt' is list"),
    ({"prompt": {"q": "a"}, "answer": "1"}, r"record 1: column 'prompt' is dict"),
    ({"prompt": "fine", "answer": "1", "completions": "x"}, r"has a column named 'completions', which reward functions "
                                                            r"receive as their own argument; allowed: any other name"),
    ({"prompt": "fine", "answer": "1", "prompts": "x"}, r"has a column named 'prompts'"),
])
def test_prompts_that_are_blank_or_not_text_and_reserved_columns_are_refused(tmp_path, bad, match):
    """Before 2026-11-25 (issue 27) each was silent: blank prompts trained on, ints / lists / dicts trained on as
    ``str(value)``, a ``completions`` or ``prompts`` column replaced what the reward functions receive (reward
    1.000 every step, nothing learned)."""
    from torchtitan_flux.errors import ConfigError

    p = tmp_path / "d.jsonl"
    rows = [ROWS[0], bad, ROWS[2]]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError, match=match):
        build_task(job(tmp_path, p), ByteTokenizer())


def test_chat_messages_without_text_content_are_refused(tmp_path):
    """Before 2026-11-25 (issue 27): a message without ``content`` was rendered empty."""
    from torchtitan_flux.errors import ConfigError

    model_dir_with_template(tmp_path)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user"}], "answer": "1"}) + "\n")
    with pytest.raises(ConfigError, match=r"record 0: column 'messages' must be a list of \{'role', 'content'\} "
                                          r"messages with text content; got \[\{'role': 'user'\}\]"):
        build_task(job(tmp_path, chat), ByteTokenizer())


# ----------------------------------------------------------------------------------------- prompt length

def test_over_long_prompts_are_dropped_and_counted_or_refused(tmp_path, caplog):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"prompt": "x" * n, "answer": ""}) + "\n" for n in (5, 30, 6, 40)))
    with caplog.at_level("WARNING", logger="torchtitan_flux"):
        task = build_task(job(tmp_path, p, max_prompt_tokens=20), ByteTokenizer())
    assert [len(r.text) for r in task.records] == [5, 6]
    assert "dropped 2 of 4 prompts" in caplog.text
    with pytest.raises(ValueError, match=r"2 of 4 prompts exceed rollout.max_prompt_tokens = 20 \(record 1 has 31"):
        build_task(job(tmp_path, p, max_prompt_tokens=20, long_prompts="error"), ByteTokenizer())
    auto = build_task(job(tmp_path, p), ByteTokenizer())  # 0: seq_len 64 - max_new_tokens 8 = 56 tokens
    assert len(auto.records) == 4


def test_long_prompt_messages_name_the_budget_and_the_seq_len_that_fits(tmp_path, caplog):
    """With the default rollout.max_prompt_tokens = 0 the limit is training.seq_len - max_new_tokens: the messages
    say so and name the seq_len that would keep every prompt (before: 'raise max_prompt_tokens', a field left 0)."""
    from torchtitan_flux.errors import ConfigError

    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"prompt": "x" * n, "answer": ""}) + "\n" for n in (5, 60, 70)))
    limit = "training.seq_len - rollout.max_new_tokens = 64 - 8 = 56 tokens (rollout.max_prompt_tokens = 0)"
    fix = "training.seq_len >= 79 (longest prompt + rollout.max_new_tokens)"  # 71 tokens (BOS) + 8
    with caplog.at_level("WARNING", logger="torchtitan_flux"):
        build_task(job(tmp_path, p), ByteTokenizer())
    assert f"dropped 2 of 3 prompts longer than {limit} (the longest has 71 tokens; {fix} keeps them)" in caplog.text
    with pytest.raises(ConfigError, match=re.escape(f"2 of 3 prompts exceed {limit} (record 1 has 61 tokens, the "
                                                    f"longest 71); allowed: {fix}, or rollout.long_prompts = 'drop'")):
        build_task(job(tmp_path, p, long_prompts="error"), ByteTokenizer())
    p.write_text(json.dumps({"prompt": "x" * 70, "answer": ""}) + "\n")
    with pytest.raises(ConfigError, match=re.escape("every prompt exceeds rollout.max_prompt_tokens = 20 (the shortest "
                                                    "has 71 tokens); allowed: rollout.max_prompt_tokens >= 71 with "
                                                    "training.seq_len >= 79")):
        build_task(job(tmp_path, p, max_prompt_tokens=20), ByteTokenizer())


def test_prompt_budget_is_validated_against_seq_len(tiny_model_dir):
    from test_config import parse

    from torchtitan_flux.errors import ConfigError
    from torchtitan_flux.run.validation import validate_config

    with pytest.raises(ConfigError, match=r"rollout.max_prompt_tokens \(60\) \+ rollout.max_new_tokens \(16\) must fit "
                                          r"in training.seq_len = 64"):
        validate_config(parse("--rollout.max_prompt_tokens", "60"))
    with pytest.raises(ConfigError, match="rollout.max_new_tokens"):
        validate_config(parse("--rollout.max_new_tokens", "64"))
    validate_config(parse("--rollout.max_prompt_tokens", "48"))


# ------------------------------------------------------------------------------------------------ rewards

def batched_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


async def async_has_digit(completions, **kwargs):
    await asyncio.sleep(0.01)
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def only_level_zero(completions, level, **kwargs):  # None: not applicable to that sample
    return [1.0 if lv == 0 else None for lv in level]


def test_batched_async_and_none_rewards_with_weights_and_metrics():
    funcs = [R.RewardFunc("len", batched_len, 0.5), R.RewardFunc("digit", async_has_digit, 2.0),
             R.RewardFunc("lvl", only_level_zero, 1.0)]
    scorer = R.RewardScorer(funcs)
    try:
        fut = scorer.submit(["p"] * 4, ["a1", "bb", "", "c"], [[1], [2], [], [3]], {"level": [0, 1, 0, 2]})
        s = fut.result(timeout=10)
    finally:
        scorer.close()
    assert s.per_func["lvl"] == [1.0, None, 1.0, None]
    assert s.total == [0.5 * 2 + 2.0 * 1 + 1.0, 0.5 * 2, 0.0 + 1.0, 0.5 * 1]
    m = s.metrics()
    assert m["rewards/len/mean"] == 1.25 and math.isclose(m["rewards/len/std"], math.sqrt(0.6875))
    assert m["rewards/digit/mean"] == 0.25 and m["rewards/lvl/mean"] == 1.0 and m["rewards/lvl/std"] == 0.0


def raises_on_third(completions, **kwargs):
    if len(completions) > 2:
        raise KeyError("boom")
    return [0.0] * len(completions)


def wrong_length(completions, **kwargs):
    return [0.0]


def nan_at_one(completions, **kwargs):
    return [0.0, float("nan")]


def not_a_list(completions, **kwargs):
    return 1.0


@pytest.mark.parametrize("fn, match", [
    (raises_on_third, r"reward function 'f' raised KeyError: 'boom'"),
    (wrong_length, r"reward function 'f' returned 1 values for 3 completions"),
    (not_a_list, r"reward function 'f' returned float; it must return a list of 3"),
])
def test_bad_rewards_stop_with_the_function_and_sample(fn, match):
    scorer = R.RewardScorer([R.RewardFunc("f", fn)])
    with pytest.raises(R.RewardError, match=match):
        scorer.submit(["good", "bad", "x"], ["1", "2", "3"], [[], [], []], {"answer": ["1", "1", "1"]}).result()
    scorer.close()
    with pytest.raises(R.RewardError, match=r"returned nan for sample 1"):
        R.RewardScorer([R.RewardFunc("n", nan_at_one)]).score(["a", "b"], ["", ""], [[], []], {})


class _Unprintable(Exception):
    def __str__(self):
        raise ValueError("no")


def _values(*vs):
    return lambda completions, **_: list(vs)


@pytest.mark.parametrize("funcs, match", [
    ([("f", _values(1e308, 0.0), 1.0)], r"^reward function 'f' returned 1e\+308 for sample 0; allowed: a finite number "
                                        r"within \+-3.4e\+38 \(float32"),
    ([("f", _values(-1e308, 0.0), 1.0)], r"returned -1e\+308 for sample 0"),
    ([("f", _values(10**400, 0.0), 1.0)], r"returned 10000000000000000000\.\.\.\(401 characters\) for sample 0"),
    ([("f", _values(3e38, 0.0), 1.0), ("g", _values(3e38, 0.0), 1.0)],
     r"^the weighted reward of sample 0 is 6e\+38 \('f' 3e\+38 x weight 1, 'g' 3e\+38 x weight 1\): beyond "
     r"float32"),
    ([("f", _values(1.0, 0.0), 1e308)], r"^the weighted reward of sample 0 is 1e\+308 \('f' 1.0 x weight 1e\+308\)"),
    ([("f", lambda completions, **_: (_ for _ in ()).throw(_Unprintable()), 1.0)],
     r"^reward function 'f' raised _Unprintable: \(its message cannot be read\) \(test_data\.py:410\)$"),
])
def test_reward_values_beyond_float32_and_broken_exceptions_are_one_line(funcs, match):
    """Before 2026-11-27: +-1e308 and 10**400 were OverflowError tracebacks, a weight of 1e308 a non-finite loss
    naming nothing, and an exception whose ``str()`` raised broke the error's own formatting."""
    scorer = R.RewardScorer([R.RewardFunc(name, fn, w) for name, fn, w in funcs])
    with pytest.raises(R.RewardError, match=match):
        scorer.score(["a", "b"], ["", ""], [[], []], {})
    scorer.close()


def test_a_reward_that_closes_stdout_is_named(monkeypatch):
    import io
    import sys

    monkeypatch.setattr(sys, "stdout", io.StringIO())

    def closes(completions, **_):
        sys.stdout.close()
        return [0.0] * len(completions)

    with pytest.raises(R.RewardError, match=r"^reward function 'c' closed sys.stdout; allowed: leave"):
        R.RewardScorer([R.RewardFunc("c", closes)]).score(["a"], [""], [[]], {})


def test_rewards_of_1e38_log_a_finite_mean():
    """Before 2026-11-27 the row's ``reward_mean`` of 32 rewards of 1e38 was a float32 sum past its range: null."""
    import torch

    from torchtitan_flux.run.report import StepTimes, step_row

    from torchtitan_flux.rollout.batch import RolloutBatch

    mask = torch.zeros(32, 3)
    mask[:, 2] = 1.0
    batch = RolloutBatch(step=1, tokens=torch.zeros(32, 4, dtype=torch.long), loss_mask=mask,
                         behaviour_logprobs=torch.zeros(32, 3), rewards=torch.full((32,), 1e38),
                         versions=torch.zeros(32, dtype=torch.long), token_versions=torch.where(mask > 0, 0, -1),
                         dispatch_version=0, newest_seen=0, gen_time_s=0.0)
    row = step_row(1, batch, StepTimes(0.0, 1.0, 2.0, 3.0, 0.5), {}, {})
    assert math.isfinite(row["reward_mean"]) and row["reward_mean"] == pytest.approx(1e38, rel=1e-6)


def numpy_and_torch_scalars(completions, **kwargs):
    import numpy as np
    import torch

    return [np.float32(0.5), np.int64(2), torch.tensor(0.25), np.array(1.5), None][: len(completions)]


def as_numpy_array(completions, **kwargs):
    import numpy as np

    return np.array([0.5] * len(completions), dtype=np.float32)


def test_numpy_and_torch_scalars_are_taken_as_floats():
    s = R.RewardScorer([R.RewardFunc("np", numpy_and_torch_scalars), R.RewardFunc("arr", as_numpy_array)]).score(
        ["p"] * 5, ["a"] * 5, [[]] * 5, {})
    assert s.per_func["np"] == [0.5, 2.0, 0.25, 1.5, None] and all(type(v) is float for v in s.per_func["np"][:4])
    assert s.per_func["arr"] == [0.5] * 5 and s.total == [1.0, 2.5, 0.75, 2.0, 0.5]


def non_scalar_at_one(completions, **kwargs):
    import torch

    return [torch.tensor(1.0), torch.tensor([1.0, 2.0])]


def numpy_nan_at_one(completions, **kwargs):
    import numpy as np

    return [np.float32(0.0), np.float32("nan")]


def exits(completions, **kwargs):
    raise SystemExit(3)


async def async_exits(completions, **kwargs):
    raise SystemExit("bye")


def interrupts(completions, **kwargs):
    raise KeyboardInterrupt("from the function")


async def async_interrupts(completions, **kwargs):
    raise KeyboardInterrupt


@pytest.mark.parametrize("fn, match", [
    (non_scalar_at_one, r"reward function 'f' returned tensor\(\[1\., 2\.\]\) for sample 1; allowed: a finite number"),
    (numpy_nan_at_one, r"reward function 'f' returned nan for sample 1"),
    (exits, r"reward function 'f' raised SystemExit: 3 \(test_data\.py:487\)$"),  # the user's frame ends it
    (async_exits, r"reward function 'f' raised SystemExit: bye \(test_data\.py:491\)$"),
    (interrupts, r"reward function 'f' raised KeyboardInterrupt: from the function \(test_data\.py:495\)$"),  # before
    (async_interrupts, r"reward function 'f' raised KeyboardInterrupt \(test_data\.py:499\)$"),  # (issue 27's
    # second sweep): a traceback
])
def test_bad_scalars_and_sys_exit_in_a_reward_fail_with_one_line(fn, match):
    """Before: ``sys.exit()`` in a reward escaped the thread pool as SystemExit and ended the run silently."""
    with pytest.raises(R.RewardError, match=match):
        R.RewardScorer([R.RewardFunc("f", fn)]).submit(["a", "b"], ["", ""], [[], []], {"answer": ["", ""]}).result()


def test_a_reward_that_edits_its_arguments_misleads_no_other():
    """Before (issue 27's second sweep): the functions shared the lists, so one that rewrote ``completions`` in
    place silently changed what the next one scored."""
    def rewrites(completions, **kwargs):
        completions[:] = ["x"] * len(completions)
        kwargs["answer"].clear()
        return [0.0] * len(completions)

    def length(completions, answer, **kwargs):
        return [float(len(c) + len(answer)) for c in completions]

    funcs = [R.RewardFunc("rewrites", rewrites), R.RewardFunc("length", length)]
    scores = R.RewardScorer(funcs).submit(["a", "b"], ["abc", ""], [[], []], {"answer": ["", ""]}).result()
    assert scores.per_func["length"] == [5.0, 2.0]


def test_a_failing_reward_is_reported_as_one_error_line(capsys):
    from torchtitan_flux.patches import apply_patches
    from torchtitan_flux.train import _report

    apply_patches()  # _report imports the trainer (torchtitan)
    assert _report(R.RewardError("reward function 'f' raised SystemExit: 3")) == 2
    assert capsys.readouterr().err == "error: reward function 'f' raised SystemExit: 3\n"


def test_reward_config_resolution(tmp_path):
    path = write(tmp_path, "jsonl")
    task = build_task(job(tmp_path, path, reward_funcs=["test_data:batched_len", "answer_match"],
                          reward_weights=[0.1, 1.0]), ByteTokenizer())
    assert [(f.name, f.weight) for f in task.reward_funcs] == [("batched_len", 0.1), ("answer_match", 1.0)]
    with pytest.raises(ValueError, match="^rollout.task = 'jsonl' was renamed: use 'dataset'$"):
        build_task(job(tmp_path, path, task="jsonl"), ByteTokenizer())
    with pytest.raises(ValueError, match="no reward of its own"):
        build_task(job(tmp_path, path, reward_funcs=[]), ByteTokenizer())


# ------------------------------------------------------------------------------------------ GSM8K answers

@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48/2 = 24 clips in May.\nIn total 48+24 = 72 clips.\n#### 72", "72"),
    ("first 3, then 5, so the answer is 8", "8"),  # several numbers: the last
    ("The total is 1,234,567 dollars.", "1234567"),  # thousands separators
    ("It dropped to -15 degrees", "-15"),  # negative
    ("x = \\boxed{\\frac{1}{2}} and later 7", "\\frac{1}{2}"),  # boxed (nested braces) beats the last number
    ("\\boxed{12} or \\boxed{13}", "13"),  # the last box
    ("#### $1,000.", "1000"),  # after ####, $ and a trailing dot dropped
    ("The answer is 42.0", "42"),
    ("it is 3.50 each", "3.5"),
    ("#### 5\nbut maybe 6", "5"),  # #### wins over a later number
    ("no answer here", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert R.extract_answer(text) == expected


def test_arithmetic_uses_the_final_answer(tmp_path):
    task = build_task(job(tmp_path, "", task="arithmetic", reward_funcs=[]), ByteTokenizer())
    p = task.prompts(3, 1, 1)[0]
    ans = p.answer
    prompts, comps, cols = reward_inputs(task, [p], [f"7 then {ans}", f" {ans} and 7", "none"], 3)
    assert task.reward_funcs[0].fn(prompts=prompts, completions=comps, **cols) == [1.0, 0.0, 0.0]


def test_math_verify_reward():
    """math-verify is in the dev extras: a broken install fails here instead of skipping."""
    assert R.math_verify_reward(["so $\\frac{1}{2}$", "it is 0.5", "3"], ["#### 0.5"] * 3) == [1.0, 1.0, 0.0]


# --------------------------------------------------------------------------------------------- sampling

def test_epochs_without_replacement_and_resume_mid_epoch(tmp_path):
    path = write(tmp_path, "jsonl")
    cfg = job(tmp_path, path)
    task = build_task(cfg, ByteTokenizer())
    steps = [[p.text for p in task.prompts(0, step, 3)] for step in range(1, 11)]  # 30 draws over 10 records
    flat = [t for s in steps for t in s]
    for epoch in range(3):
        assert sorted(flat[epoch * 10 : epoch * 10 + 10]) == sorted(r["prompt"] for r in ROWS)
    assert flat[:10] != flat[10:20]  # each epoch reshuffled
    resumed = build_task(cfg, ByteTokenizer())  # a fresh process resuming at step 5 (mid-epoch 2)
    assert [[p.text for p in resumed.prompts(0, s, 3)] for s in range(5, 11)] == steps[4:]
    other_seed = build_task(job(tmp_path, path, seed=1), ByteTokenizer())
    assert [p.text for p in other_seed.prompts(1, 1, 10)] != flat[:10]


def test_sampler_positions():
    s = EpochSampler(4, seed=3)
    assert sorted(s.indices(0, 4)) == [0, 1, 2, 3] and sorted(s.indices(4, 4)) == [0, 1, 2, 3]
    assert s.indices(2, 4) == s.indices(2, 2) + s.indices(4, 2) and s.epoch(9) == 2


# TRL's documented examples (GRPOTrainer docs, "Using a custom reward function"), copied as a user would
def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def test_trl_documented_rewards_work_unchanged(tmp_path):
    p = tmp_path / "std.jsonl"
    p.write_text(json.dumps({"prompt": "1+1?", "ground_truth": "2"}) + "\n")
    task = build_task(job(tmp_path, p, reward_funcs=["test_data:reward_func"]), ByteTokenizer())
    prompts, comps, cols = reward_inputs(task, task.records, ["so \\boxed{2}", "\\boxed{3}"], 2)
    assert R.RewardScorer(task.reward_funcs).score(prompts, comps, [[], []], cols).total == [1.0, 0.0]

    model_dir_with_template(tmp_path)
    c = tmp_path / "chat.jsonl"
    c.write_text(json.dumps({"prompt_msgs": [{"role": "user", "content": "hi"}]}) + "\n")
    chat = build_task(job(tmp_path, c, messages_column="prompt_msgs", reward_funcs=["test_data:format_reward_func"]),
                      ByteTokenizer())
    prompts, comps, cols = reward_inputs(chat, chat.records, ["<think>x</think><answer>2</answer>", "2"], 2)
    assert R.RewardScorer(chat.reward_funcs).score(prompts, comps, [[], []], cols).total == [1.0, 0.0]


def my_task(job_config, tokenizer, dataset_path, dataset_split, field_name):  # a user's task factory
    from torchtitan_flux.data.tasks import DigitsTask

    return DigitsTask()


def test_task_registry_takes_a_users_factory(tmp_path):
    task = build_task(job(tmp_path, "", task="test_data:my_task", reward_funcs=["test_data:batched_len"]),
                      ByteTokenizer())
    assert task.name == "digits" and [f.name for f in task.reward_funcs] == ["batched_len"]
    with pytest.raises(ValueError, match="rollout.task = 'nope' is not allowed"):
        build_task(job(tmp_path, "", task="nope"), ByteTokenizer())


def test_scoring_starts_when_a_steps_results_arrive_not_when_the_trainer_asks():
    """The reward pool scores a step as soon as its last result is pumped, so in async mode scoring of step k+1
    overlaps the training of step k (the main thread is free meanwhile)."""
    import queue
    import threading
    import time

    from test_dispatch import FakeEngine, FakeTokenizer

    from torchtitan_flux.rollout.rollouts import Rollouts
    from torchtitan_flux.data.tasks import Prompt

    started = threading.Event()

    def slow(completions, **kwargs):
        started.set()
        time.sleep(0.3)
        return [1.0] * len(completions)

    task = SimpleNamespace(chat=False, reward_funcs=[R.RewardFunc("slow", slow)],
                           prompts=lambda seed, step, n: [Prompt(f"p{step}_{i}") for i in range(n)])
    events: queue.Queue = queue.Queue()
    sched = Rollouts(
        [FakeEngine("e0", 100.0, events)], events, task, FakeTokenizer(), group_size=2, prompts_per_step=2,
        max_new_tokens=1, temperature=1.0, top_k=0, seed=0, pad_id=0,
    )
    sched.dispatch(1, 0)
    t0 = time.perf_counter()
    sched.pump.pump(10.0)  # the step's only result arrives: scoring is handed to the pool, pump returns at once
    assert time.perf_counter() - t0 < 5.0 and started.wait(5.0)  # not after 10 s (bounds hold under load)
    batch = sched.collect(1, 0)
    assert batch.rewards.tolist() == [1.0] * 4 and batch.reward_metrics["rewards/slow/mean"] == 1.0
    sched.drain(0)


def test_checkpointed_data_state_detects_a_changed_dataset(tmp_path):
    path = write(tmp_path, "jsonl")
    task = build_task(job(tmp_path, path), ByteTokenizer())
    saved = task.data_state(step=4, prompts_per_step=3)  # what the trainer checkpoints after step 4
    assert saved["position"] == 12 and saved["epoch"] == 1 and saved["records"] == 10
    assert build_task(job(tmp_path, path), ByteTokenizer()).check_resume(saved, 4, 3) is None
    path.write_text(path.read_text() + json.dumps({"prompt": "new", "answer": "0"}) + "\n")
    msg = build_task(job(tmp_path, path), ByteTokenizer()).check_resume(saved, 4, 3)
    assert msg and "records, sha1 changed" in msg
    assert "position changed" in task.check_resume(saved, 4, 2)  # prompts_per_step changed on resume
    # every answer changed, the prompts not: a different run too (before 2026-11-27 only prompt texts were hashed)
    rows = [json.loads(x) for x in path.read_text().splitlines()[:10]]
    path.write_text("".join(json.dumps({**r, "answer": r["answer"] + "7"}) + "\n" for r in rows))
    msg = build_task(job(tmp_path, path), ByteTokenizer()).check_resume(saved, 4, 3)
    assert msg and "sha1 changed" in msg and "records changed" not in msg


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_reward_that_never_returns_fails_at_its_deadline_naming_it(is_async):
    """Before 2026-11-25 a reward function that never returned froze the run with no note (issue 27); now the wait
    for its batch raises ``RewardError`` naming it once it has run ``timeout_s``, and a stop request ends the wait."""
    import asyncio
    import threading
    import time

    release = threading.Event()

    def stuck(completions, **_):
        release.wait(60)
        return [0.0] * len(completions)

    async def stuck_async(completions, **_):
        while not release.is_set():
            await asyncio.sleep(0.01)
        return [0.0] * len(completions)

    fast = R.RewardFunc("fast", lambda completions, **_: [1.0] * len(completions))
    scorer = R.RewardScorer([fast, R.RewardFunc("slow", stuck_async if is_async else stuck)], timeout_s=0.5)
    try:
        t0 = time.monotonic()
        future = scorer.submit(["a"], [""], [[]], {})
        with pytest.raises(R.RewardError, match=r"^reward function 'slow' did not return within "
                                                r"rollout.reward_timeout_seconds = 0.5 \("):
            scorer.wait(future)
        assert 0.5 <= time.monotonic() - t0 < 10  # at its deadline, not never (a bound that holds under load)
        t0 = time.monotonic()
        assert scorer.wait(scorer.submit(["a"], [""], [[]], {}), interrupted=lambda: True) is None  # a stop
        assert time.monotonic() - t0 < 1
        release.set()
        assert scorer.wait(future).total == [1.0]  # a slow function within its deadline is waited for
    finally:
        release.set()
        scorer.close()


def test_the_progress_line_survives_non_finite_and_missing_values(tmp_path):
    """Before 2026-11-25 (issue 27): rewards of 1e38 made ``reward_mean`` non-finite, the row held None, and the
    progress line raised ``TypeError: unsupported format string passed to NoneType.__format__``."""
    from torchtitan_flux.run.metrics import MetricsWriter

    w = MetricsWriter(str(tmp_path), total_steps=3)
    try:
        line = w.progress_line(1, {"reward_mean": None, "loss": float("inf"), "staleness": None, "async_ratio": 1})
        assert line.startswith("step     1/3  reward nan  loss +inf  staleness nan  async 1.00"), line
    finally:
        w.close()


@pytest.mark.parametrize("case", ["mixed folder", "empty folder", "damaged parquet", "ragged csv", "csv column twice"])
def test_dataset_files_the_library_cannot_read_are_one_line(tmp_path, case):
    """Before 2026-11-25 (issue 27): the datasets library's traceback (empty folder, damaged parquet), or a mixed
    folder read as one of its file types with the others silently left out."""
    from torchtitan_flux.errors import ConfigError
    from torchtitan_flux.data.datasets import load_table

    d = tmp_path / "data"
    d.mkdir()
    if case == "mixed folder":
        (d / "a.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
        (d / "b.csv").write_text("prompt,answer\nq?,1\n")
        match = r" mixes data files of types \['\.csv', '\.jsonl'\]; allowed: files of one type in a folder"
    elif case == "empty folder":
        match = r" cannot be read as a dataset \(EmptyDatasetError: .*\); allowed: a \.jsonl"
    elif case == "csv column twice":  # before (issue 27's second sweep): trained on the first 'prompt', silently
        (d / "a.csv").write_text("prompt,answer,prompt\nq?,1,r?\n")
        d = d / "a.csv"
        match = r": column\(s\) \['prompt'\] appear more than once in the header; allowed: each column name once"
    elif case == "ragged csv":  # before (issue 27's second sweep): only "An error occurred while generating ..."
        d = d / "bad.csv"
        d.write_text("prompt,answer\nq?,1\nr?,2,3\n")
        match = (r" cannot be read as a dataset \(DatasetGenerationError: .* \(from ParserError: Error tokenizing "
                 r"data. C error: Expected 2 fields in line 3, saw 3\)\)")
    else:
        d = d / "bad.parquet"
        d.write_text("not parquet")
        match = r" cannot be read as a dataset \(ArrowInvalid: Parquet magic bytes not found"
    with pytest.raises(ConfigError, match=rf"^rollout.dataset_path = '{re.escape(str(d))}'{match}"):
        load_table(str(d), "train")


def test_closing_metrics_on_a_full_disk_is_a_warning_not_an_error(tmp_path, caplog):
    """Before 2026-11-27 the flush in ``close()`` raised after the run had already stopped on the full disk, and its
    traceback replaced the one line saying why."""
    import errno

    from torchtitan_flux.run.metrics import MetricsWriter

    class FullDisk:
        name = str(tmp_path / "metrics.jsonl")

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    w = MetricsWriter(str(tmp_path), total_steps=3)
    w._f.close()
    w._f = FullDisk()
    with caplog.at_level("WARNING", logger="torchtitan_flux"):
        w.close()
    assert any("could not flush" in r.getMessage() and "No space left" in r.getMessage() for r in caplog.records)


def test_every_evaluation_is_printed_when_it_finishes(tmp_path, caplog):
    """Before 2026-11-27 only the ``eval.at_start`` evaluation was printed; later ones reached ``eval.jsonl`` and the
    step rows only (in an async run step 10's evaluation lands in step 12's row: the line names its version)."""
    from torchtitan_flux.run.metrics import MetricsWriter

    w = MetricsWriter(str(tmp_path), total_steps=20)
    try:
        with caplog.at_level("INFO", logger="torchtitan_flux"):
            w.log(0, {"eval_only": True, "eval/version": 0, "eval/reward_mean": 0.1, "eval/pass@1": 0.25}, progress=False)
            w.log(12, {"reward_mean": 0.5, "loss": 0.0, "eval/version": 10, "eval/reward_mean": 0.4, "eval/pass@1": 0.5})
            w.log(13, {"reward_mean": 0.5, "loss": 0.0})
    finally:
        w.close()
    evals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval of version")]
    assert evals == ["eval of version 0: reward 0.100  pass@1 0.250", "eval of version 10: reward 0.400  pass@1 0.500"]


def test_a_probe_mismatch_names_the_tolerance_a_lower_precision_engine_needs():
    """Before 2026-11-27 a bfloat16 wire on the real model stopped at step 2 (0.139 > 0.1) with no word of the
    tolerance, which such engines need raised."""
    import torch

    from torchtitan_flux.errors import ProbeMismatch
    from torchtitan_flux.sync.probe import compare

    expected = torch.tensor([-1.0, -2.0])
    assert compare("e0", 2, [5, 6, 7], expected, [-1.0, -2.05], tolerance=0.1).max_abs_diff == pytest.approx(0.05)
    with pytest.raises(ProbeMismatch, match=r"max \|logprob difference\| 0.139 > weight_sync.probe_tolerance 0.1.*"
                                            r"raise weight_sync.probe_tolerance for it"):
        compare("e0", 2, [5, 6, 7], expected, [-1.0, -2.139], tolerance=0.1)


async def _one_value(completions, **_):
    return [1.0]


@pytest.mark.parametrize("values, match", [
    (lambda n: {"a": 1.0}, r"returned dict; it must return a list of 2 floats"),
    (lambda n: {1.0, 2.0}, r"returned set; it must return a list of 2"),
    (lambda n: (1.0 for _ in range(n)), r"returned generator; it must return a list of 2"),
    (lambda n: __import__("numpy").ones((n, 1)), r"returned ndarray; it must return a list of 2"),
    (lambda n: __import__("torch").ones(n, 2), r"returned Tensor; it must return a list of 2"),
    (lambda n: [[1.0]] * n, r"returned \[1.0\] for sample 0; allowed: a finite number"),
    (lambda n: ["1.0"] * n, r"returned '1.0' for sample 0; allowed: a finite number"),
    (lambda n: [__import__("fractions").Fraction(1, 2)] * n, r"returned Fraction\(1, 2\) for sample 0"),
    (lambda n: [__import__("decimal").Decimal("0.5")] * n, r"returned Decimal\('0.5'\) for sample 0"),
    (lambda n: [1j] * n, r"returned 1j for sample 0"),
    (lambda n: [True] * n, r"returned True for sample 0"),
    (lambda n: __import__("torch").tensor([float("nan")] * n), r"returned nan for sample 0"),
    (lambda n: None, r"returned NoneType; it must return a list of 2"),
])
def test_reward_values_of_every_wrong_shape_are_one_line(values, match):
    """Our own cases beyond the sweeps': containers, shapes and number types a reward might return."""
    scorer = R.RewardScorer([R.RewardFunc("f", lambda completions, **_: values(len(completions)))])
    with pytest.raises(R.RewardError, match=rf"^reward function 'f' {match}"):
        scorer.score(["a", "b"], ["", ""], [[], []], {})
    with pytest.raises(R.RewardError, match=r"^reward function 'f' returned 1 values for 2 completions$"):
        R.RewardScorer([R.RewardFunc("f", _one_value)]).score(["a", "b"], ["", ""], [[], []], {})


def test_an_environments_dataset_needs_no_prompt_column(tmp_path):
    """With rollout.environment a record is the environment's input and its init() writes the opening: a dataset of
    such records was refused for having no prompt column. Mutation: the prompt column required, or the record's
    columns not passed whole."""
    from torchtitan_flux.rollout.episode_groups import env_input

    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} * 3?", "answer": str(3 * i)}) + "\n"
                            for i in range(5)))
    with pytest.raises(ValueError, match=r"it needs a text column .* \(or rollout.environment: its records need none\)"):
        build_task(job(tmp_path, path), ByteTokenizer())
    task = build_task(job(tmp_path, path, environment="examples.environments.calculator:CalculatorEnv",
                          environment_reward_weight=1.0),
                      ByteTokenizer())
    prompts = task.prompts(0, 1, 5)
    assert sorted(p.answer for p in prompts) == ["0", "12", "3", "6", "9"]
    record = env_input(prompts[0])
    assert record["question"] == f"What is {int(record['answer']) // 3} * 3?" and record["answer"] == prompts[0].answer
