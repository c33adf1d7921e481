"""reasoning-gym's tasks (``rollout.task = "reasoning_gym:<name>"``, issue 47): the draw is a function of (seed, step)
and never a held-out question, the held-out set is fixed, the reward is the dataset's own ``score_answer`` of the
``<answer>`` element, bad ``rollout.task_args`` are one line naming the field before any model is built, a missing
package names the extra, and a checkpoint records the draw. reasoning-gym is installed by scripts/setup.sh (the
``tasks`` extra); nothing here needs the network."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from conftest import DEBUG_TOML

from torchtitan_flux.patches import apply_patches

apply_patches()


from torchtitan_flux.data.rewards import RewardScorer, reward_inputs  # noqa: E402
from torchtitan_flux.data.tasks import ReasoningGymTask, build_task, task_factory  # noqa: E402
from torchtitan_flux.errors import ConfigError  # noqa: E402
from torchtitan_flux.run.resume import fingerprint  # noqa: E402
from torchtitan_flux.run.validation import validate_config  # noqa: E402
from torchtitan_flux.run.config_file import load_config
from torchtitan_flux.run.trainer import GRPOTrainer  # noqa: E402

EASY = ["min_terms=2", "max_terms=2", "max_digits=1", 'operators=["+"]', "allow_parentheses=false",
        "allow_negation=false"]


class ByteTokenizer:
    def encode(self, text, add_bos=True, add_eos=False):
        return ([1] if add_bos else []) + list(text.encode())


def job(task_args=EASY, seq_len=2048, num_prompts=16, chat_dir=None, **rollout):
    r = dict(task="reasoning_gym:basic_arithmetic", task_args=list(task_args), dataset_path="", dataset_split="train",
             seed=0, apply_chat_template=bool(chat_dir), max_prompt_tokens=0, max_new_tokens=16, reward_funcs=[],
             reward_weights=[], environment="")
    r.update(rollout)
    return SimpleNamespace(rollout=SimpleNamespace(**r), training=SimpleNamespace(seq_len=seq_len),
                           hf_assets_path=str(chat_dir),
                           eval=SimpleNamespace(num_prompts=num_prompts, every_steps=0, at_start=False))


def parse(*overrides: str):
    return load_config(["--job.config_file", str(DEBUG_TOML), *overrides], GRPOTrainer.Config())


def score(task, prompts, completions):
    p_in, c_in, columns = reward_inputs(task, prompts, completions, 1)
    scorer = RewardScorer(task.reward_funcs)
    try:
        return scorer.wait(scorer.submit(p_in, c_in, [[]] * len(c_in), columns)).total
    finally:
        scorer.close()


def test_the_draw_is_a_function_of_seed_and_step_and_never_a_held_out_question():
    task = build_task(job(), ByteTokenizer())
    assert isinstance(task, ReasoningGymTask) and task.name == "reasoning_gym:basic_arithmetic"
    held = task.eval_prompts(0, 0)
    assert len(held) == 16 and [p.text for p in held] == [p.text for p in task.eval_prompts(0, 0)]
    assert [p.text for p in task.eval_prompts(0, 5)] == [p.text for p in held[:5]]
    steps = {s: task.prompts(0, s, 8) for s in (1, 2, 3)}
    again = build_task(job(), ByteTokenizer())  # a resumed run builds the task afresh
    assert [p.text for p in again.prompts(0, 3, 8)] == [p.text for p in steps[3]]
    assert [p.text for p in steps[1]] != [p.text for p in steps[2]]
    # one-digit sums: about 100 questions, 16 held out, which the training seed's items hold too: redrawn
    held_questions = {p.columns["question"] for p in held}
    assert any(task.train[i]["question"] in held_questions for i in range(task.config.size))
    drawn = {p.columns["question"] for s in range(1, 40) for p in task.prompts(0, s, 8)}
    assert len(drawn) > 40 and not drawn & held_questions
    assert [p.text for p in task.prompts(1, 1, 8)] != [p.text for p in steps[1]]  # another rollout.seed
    assert task.prompts(0, 1, 1)[0].text.startswith("Given a problem, your task is")  # reasoning-gym's default


def test_the_reward_is_the_datasets_score_answer_of_the_answer_element():
    task = build_task(job(), ByteTokenizer())
    prompts = task.prompts(0, 1, 3)
    right = [f"<answer>{p.answer}</answer>" for p in prompts]
    assert score(task, prompts, right) == [1.0, 1.0, 1.0]
    wrong = [f"<answer>{int(p.answer) + 1}</answer>" for p in prompts]
    assert score(task, prompts, wrong) == [0.0, 0.0, 0.0]
    # no <answer> element scores 0 even when the number is there; the last element counts
    assert score(task, prompts[:2], [prompts[0].answer, f"<answer>0</answer> <answer>{prompts[1].answer}</answer>"]) \
        == [0.0, 1.0]


def test_examples_and_the_system_prompt_make_a_chat_prompt(chatml_dir):
    task = build_task(job(EASY + ["system_prompt=direct", "examples=2"], chat_dir=chatml_dir), ByteTokenizer())
    p = task.prompts(0, 1, 1)[0]
    assert task.chat and not p.add_bos and [m["role"] for m in p.messages] == ["system", "user", "assistant", "user",
                                                                               "assistant", "user"]
    assert p.messages[0]["content"].startswith("Answer the question directly.")
    assert p.messages[2]["content"] == f"<answer>{task.examples[0]['answer']}</answer>"
    assert p.messages[-1]["content"] == p.columns["question"] and p.messages[-1]["content"] in p.text
    assert score(task, [p], [f"<answer>{p.answer}</answer>"]) == [1.0]  # TRL's conversational completions


@pytest.mark.parametrize("args, message", [
    (["max_terms=many"], r"rollout.task_args sets max_terms = 'many' \(str\); allowed: int"),
    (["format_style=fancy"], r"rollout.task_args sets format_style = 'fancy' \(str\); allowed: Literal\['simple', "),
    (["terms=3"], r"rollout.task_args has 'terms=3'; allowed: 'name=value' with name one of \['allow_negation', .*"
                  r"\['examples', 'system_prompt'\]"),
    (["seed=3"], r"rollout.task_args has 'seed=3'; allowed: .*seed comes from rollout.seed"),
    (["system_prompt=terse"], r"rollout.task_args sets system_prompt = 'terse'; allowed: one of \['DeepSeekZero', "),
    (["examples=-1"], r"rollout.task_args sets examples = -1; allowed: 0 or more"),
    (["min_terms=3", "max_terms=2"], r"rollout.task_args = .*: reasoning-gym's BasicArithmeticDatasetConfig refuses "
                                     r"it \(AssertionError: max_terms must be >= min_terms\)"),
])
def test_bad_task_args_are_one_line_naming_the_field_before_any_model(args, message):
    cfg = parse("--rollout.task", "reasoning_gym:basic_arithmetic", "--rollout.task_args", ",".join(args),
                "--training.seq_len", "512")
    with pytest.raises(ConfigError, match=message) as e:
        validate_config(cfg)
    assert "\n" not in str(e.value)


def test_an_unknown_dataset_and_task_args_without_reasoning_gym_are_refused():
    with pytest.raises(ConfigError, match=r"rollout.task = 'reasoning_gym:sums': reasoning-gym has no dataset 'sums'; "
                                          r"allowed: 'reasoning_gym:<name>' with name one of \[.*'basic_arithmetic'"):
        validate_config(parse("--rollout.task", "reasoning_gym:sums"))
    with pytest.raises(ConfigError, match=r"rollout.task_args = \['max_terms=2'\] with rollout.task = 'digits'; "
                                          r"allowed: \[\]"):
        validate_config(parse("--rollout.task_args", "max_terms=2"))


def test_without_reasoning_gym_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym raises ImportError
    with pytest.raises(ConfigError, match=r"needs the reasoning-gym package; install the extra: "
                                          r"pip install '\.\[tasks\]'"):
        validate_config(parse("--rollout.task", "reasoning_gym:basic_arithmetic"))
    assert callable(task_factory("reasoning_gym:basic_arithmetic"))  # the prefix, not 'package.module:attribute'


def test_a_prompt_that_does_not_fit_seq_len_is_refused_naming_the_fix():
    with pytest.raises(ConfigError, match=r"rollout.task = 'reasoning_gym:basic_arithmetic': the held-out prompt of "
                                          r".* has \d+ tokens, more than training.seq_len - rollout.max_new_tokens = "
                                          r"200 - 16 = 184 tokens .*; allowed: .* or a larger training.seq_len"):
        build_task(job(seq_len=200), ByteTokenizer())


def test_a_checkpoint_records_the_draw_and_a_resume_on_another_warns():
    task = build_task(job(), ByteTokenizer())
    saved = task.data_state(5, 4)
    assert saved["position"] == 20 and task.check_resume(saved, 5, 4) is None
    assert build_task(job(), ByteTokenizer()).check_resume(saved, 5, 4) is None
    other = build_task(job(EASY[:-1] + ["allow_negation=true"]), ByteTokenizer())
    assert "the reasoning-gym draw differs from the checkpoint's (config" in other.check_resume(saved, 5, 4)
    assert "position changed" in task.check_resume(saved, 6, 4)


def test_the_resume_fingerprint_holds_task_args(tiny_model_dir):
    cfg = parse("--rollout.task", "reasoning_gym:basic_arithmetic", "--rollout.task_args", ",".join(EASY),
                "--training.seq_len", "512", "--model.hf_assets_path", str(tiny_model_dir))
    fp = fingerprint(cfg, build_task(cfg, ByteTokenizer()))
    assert fp["rollout.task_args"] == EASY and "rollout.dataset_path" not in fp
