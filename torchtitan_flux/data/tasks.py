"""Tasks: where prompts come from and which reward functions score them (the built-in tasks: docs/data.md).

A task yields the ``Prompt`` records of a training step as a pure function of (seed, step), so the prompts of
every step are reproducible after a resume without any dataloader state. Its rewards are ``RewardFunc``s with
TRL's batched signature (``rewards.py``); ``rollout.reward_funcs`` replace a task's own. Besides ``TASKS``,
``rollout.task`` may name ``"reasoning_gym:<name>"`` (a reasoning-gym dataset, ``ReasoningGymTask``; recognised
before the next form) or ``"package.module:name"``: a callable ``(job_config, tokenizer, dataset_path,
dataset_split, field_name) -> Task``, ``field_name`` being the config field its errors name.

A dataset record whose prompt is null, empty or an empty message list refuses the dataset: training on the text
"None" or on nothing is a data bug, not something to skip silently.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import random
import string
from dataclasses import dataclass, field
from typing import Any, Callable

from torchtitan_flux.data import rewards as R
from torchtitan_flux.data.datasets import ChatTemplate, EpochSampler, filter_long, load_table
from torchtitan_flux.data.environments import config_args
from torchtitan_flux.errors import ConfigError, UserCodeError
from torchtitan_flux.user_code import call_with_deadline, import_spec

logger = logging.getLogger("torchtitan_flux")

BUILTIN_REWARDS: dict[str, Callable[..., list]] = {
    "answer_match": R.answer_match_reward,
    "math_verify": R.math_verify_reward,
    "digits": R.digits_reward,
}


@dataclass(frozen=True)
class Prompt:
    text: str  # what the model is given (for a chat record: the rendered template)
    answer: str = ""
    columns: dict[str, Any] = field(default_factory=dict)  # passed to the rewards (``answer`` always included)
    messages: list | None = None  # chat records: the messages, which the rewards get as ``prompts``
    add_bos: bool = True  # False for chat-templated text: the template writes its own BOS
    max_new_tokens: int = 0  # this prompt's generation budget, at most rollout.max_new_tokens (0: that)


class Task:
    """A prompt source and the reward functions that score it: those given, else its own (``own_rewards``)."""

    name: str
    own_rewards: tuple[str, ...] = ()  # names in BUILTIN_REWARDS
    chat: bool = False  # rewards get TRL's conversational format

    def __init__(self, reward_funcs: list[R.RewardFunc] | None = None):
        self.reward_funcs = reward_funcs or [R.RewardFunc(n, BUILTIN_REWARDS[n]) for n in self.own_rewards]

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        raise NotImplementedError

    def finished(self, step: int) -> bool:
        """Whether training step ``step`` is the task's last (a curriculum whose last phase has ended): the run then
        ends after it, as at ``training.steps`` (final push, checkpoint, summary; the LR schedule and the
        controller's cooldown still count to ``training.steps``). Asked on rank 0's main thread once the step's
        batch is scored; what it raises stops the run, naming the task. A task's own state is not checkpointed:
        a resumed run asks a task built afresh."""
        return False

    def eval_prompts(self, seed: int, n: int) -> list[Prompt]:
        """Held-out prompts: ``n`` of them (every record of a dataset when ``n`` is 0)."""
        return self.prompts(seed + 7_919, 0, n or 64)


TASK_TIMEOUT_FIELD = "rollout.task_timeout_seconds"


def task_prompts(task: Task, seed: int, step: int, n: int, max_new_tokens: int, timeout_s: float,
                 interrupted: Callable[[], bool] = lambda: False) -> list[Prompt]:
    """``task.prompts(seed, step, n)`` run as user code (``call_with_deadline``) and checked (``check_prompts``)."""
    what = f"task {task_name(task)!r}: prompts(seed={seed}, step={step}, n={n})"
    out = call_with_deadline(what, task.prompts, seed, step, n, timeout_s=timeout_s, field=TASK_TIMEOUT_FIELD,
                             interrupted=interrupted)
    return check_prompts(what, out, n, max_new_tokens)


def task_eval_prompts(task: Task, seed: int, n: int, max_new_tokens: int, timeout_s: float) -> list[Prompt]:
    """``task.eval_prompts(seed, n)`` as user code: ``n`` prompts, or at least one when ``n`` is 0 (every record)."""
    what = f"task {task_name(task)!r}: eval_prompts(seed={seed}, n={n})"
    out = call_with_deadline(what, task.eval_prompts, seed, n, timeout_s=timeout_s, field=TASK_TIMEOUT_FIELD)
    return check_prompts(what, out, n or None, max_new_tokens)


def task_finished(task: Task, step: int, timeout_s: float, interrupted: Callable[[], bool] = lambda: False) -> bool:
    """``task.finished(step)`` as user code; anything but a bool is refused (a truthy object is no answer)."""
    what = f"task {task_name(task)!r}: finished({step})"
    out = call_with_deadline(what, task.finished, step, timeout_s=timeout_s, field=TASK_TIMEOUT_FIELD,
                             interrupted=interrupted)
    if not isinstance(out, bool):
        raise UserCodeError(f"{what} returned {type(out).__name__} {out!r:.80}; allowed: True or False")
    return out


def check_prompts(what: str, prompts: Any, n: int | None, max_new_tokens: int) -> list[Prompt]:
    """``prompts`` as a task must return them: a list of exactly ``n`` (``None``: one or more) ``Prompt`` objects,
    each with a non-empty ``text`` and an integer ``max_new_tokens`` from 0 (``rollout.max_new_tokens``) to
    ``max_new_tokens``; else a ``UserCodeError`` naming ``what`` and the rule."""
    if not isinstance(prompts, list):
        raise UserCodeError(f"{what} returned {type(prompts).__name__} {prompts!r:.80}; allowed: a list of "
                            f"{n if n else 'one or more'} Prompt objects")
    if len(prompts) != n if n else not prompts:
        raise UserCodeError(f"{what} returned {len(prompts)} prompts; allowed: {n if n else 'one or more'}")
    for i, p in enumerate(prompts):
        if not isinstance(p, Prompt):
            raise UserCodeError(f"{what}: item {i} is {type(p).__name__} {p!r:.80}; allowed: a Prompt "
                                "(torchtitan_flux.data.tasks.Prompt)")
        if not isinstance(p.text, str) or not p.text:
            raise UserCodeError(f"{what}: prompt {i} has text {p.text!r:.80}; allowed: a non-empty string")
        if not isinstance(p.answer, str) or not isinstance(p.columns, dict) or not isinstance(p.add_bos, bool):
            raise UserCodeError(f"{what}: prompt {i} has answer {p.answer!r:.40}, columns {type(p.columns).__name__}, "
                                f"add_bos {p.add_bos!r}; allowed: a string, a dict and a bool")
        budget = p.max_new_tokens
        if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= max_new_tokens:
            raise UserCodeError(f"{what}: prompt {i} has max_new_tokens {budget!r}; allowed: an integer from 0 "
                                f"(rollout.max_new_tokens) to rollout.max_new_tokens = {max_new_tokens} (raise "
                                "rollout.max_new_tokens, and training.seq_len with it)")
    return prompts


def task_name(task: Any) -> str:
    return str(getattr(task, "name", type(task).__name__))


def _rng(seed: int, step: int) -> random.Random:
    return random.Random(seed * 1_000_003 + step)


class DigitsTask(Task):
    name = "digits"
    own_rewards = ("digits",)

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        rng = _rng(seed, step)
        return [Prompt("".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) + ":") for _ in range(n)]


class ArithmeticTask(Task):
    name = "arithmetic"
    own_rewards = ("answer_match",)

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        rng = _rng(seed, step)
        out = []
        for _ in range(n):
            a, b = rng.randrange(50), rng.randrange(50)
            out.append(Prompt(f"{a}+{b}=", str(a + b), {"answer": str(a + b)}))
        return out


class DatasetTask(Task):
    """Records of a local dataset (``data.load_table``), sampled in seeded epochs (``data.EpochSampler``)."""

    name = "dataset"
    default_prompt_columns: tuple[str, ...] = ()  # tried after rollout.prompt_column

    def __init__(self, job_config, tokenizer, dataset_path: str, dataset_split: str,
                 field_name: str = "rollout.dataset_path", reward_funcs: list[R.RewardFunc] | None = None):
        super().__init__(reward_funcs)
        r, where = job_config.rollout, f"{field_name} = {dataset_path!r}"
        table = load_table(dataset_path, dataset_split, field_name)
        cols = table.column_names
        text_col = next((c for c in (r.prompt_column, *self.default_prompt_columns) if c in cols), None)
        self.chat = text_col is None and r.messages_column in cols
        if text_col is None and not self.chat and not r.environment:
            raise ConfigError(f"{where} has columns {cols}; it needs a text column named by "
                             f"rollout.prompt_column ({r.prompt_column!r}) or a chat column named by "
                             f"rollout.messages_column ({r.messages_column!r}) (or rollout.environment: its records "
                             "need none)")
        if text_col is None and not self.chat:  # an environment's records: its init() writes the opening
            self._records_only(table, r, where)
            return
        prompt_col = r.messages_column if self.chat else text_col
        reserved = sorted(set(cols) & RESERVED_COLUMNS - {prompt_col})
        if reserved:  # else the column would replace what every reward function receives under that name
            raise ConfigError(f"{where} has a column named {reserved[0]!r}, which reward functions receive as their "
                              f"own argument; allowed: any other name (rename the column; reserved: "
                              f"{', '.join(sorted(RESERVED_COLUMNS))})")
        _refuse_empty_prompts(table[prompt_col], prompt_col, where)
        if not self.chat:
            _refuse_non_text_prompts(table[prompt_col], prompt_col, where)
        template = ChatTemplate(job_config.hf_assets_path) if self.chat or r.apply_chat_template else None
        records, lengths = [], []
        for i, row in enumerate(table.to_list()):
            value = row.pop(prompt_col)
            answer = "" if row.get(r.answer_column) is None else str(row[r.answer_column])
            columns = {"answer": row.get(r.answer_column), **row}  # as read (a CSV number stays a number)
            if template is None:
                p = Prompt(str(value), answer, columns)
            else:
                messages = value if self.chat else [{"role": "user", "content": str(value)}]
                if not isinstance(messages, list) or not all(
                        isinstance(m, dict) and "role" in m and isinstance(m.get("content"), str) for m in messages):
                    raise ConfigError(f"{where} record {i}: column {prompt_col!r} must be a list of {{'role', "
                                      f"'content'}} messages with text content; got {str(messages)[:80]}")
                p = Prompt(template.render(messages, add_generation_prompt=True), answer, columns,
                           messages if self.chat else None, add_bos=False)
            records.append(p)
            lengths.append(len(tokenizer.encode(p.text, add_bos=p.add_bos, add_eos=False)))
        self.records = filter_long(records, lengths, max_prompt_tokens(job_config), r.long_prompts, where,
                                   *prompt_budget(job_config, max(lengths)))
        self.sampler = EpochSampler(len(self.records), r.seed)

    def _records_only(self, table, r, where: str) -> None:
        """Records without a prompt column, for ``rollout.environment``: each prompt's text is its record as JSON (no
        length filter: an episode's opening is bounded by ``training.seq_len``), its columns the record."""
        reserved = sorted(set(table.column_names) & RESERVED_COLUMNS)
        if reserved:
            raise ConfigError(f"{where} has a column named {reserved[0]!r}, which reward functions receive as their "
                              f"own argument; allowed: any other name (reserved: {', '.join(sorted(RESERVED_COLUMNS))})")
        self.records = [Prompt(json.dumps(row, sort_keys=True, default=str), "" if row.get(r.answer_column) is None
                               else str(row[r.answer_column]), {"answer": row.get(r.answer_column), **row})
                        for row in table.to_list()]
        self.sampler = EpochSampler(len(self.records), r.seed)

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        if seed != self.sampler.seed:
            self.sampler = EpochSampler(len(self.records), seed)
        return [self.records[i] for i in self.sampler.indices((step - 1) * n, n)]

    def eval_prompts(self, seed: int, n: int) -> list[Prompt]:
        return self.records[: n or len(self.records)]

    def data_state(self, step: int, prompts_per_step: int) -> dict:
        """What a checkpoint records of the prompt stream after ``step``: its position (epoch, offset) and which
        records it runs over (count and a hash of each record's text, answer, columns and budget, after length
        filtering: a resume on records whose answers changed is refused like one whose prompts changed)."""
        pos = step * prompts_per_step
        digest = hashlib.sha1("\x00".join(json.dumps([p.text, p.answer, p.columns, p.max_new_tokens], sort_keys=True,
                                                 default=str) for p in self.records).encode()).hexdigest()
        return {"position": pos, "epoch": self.sampler.epoch(pos), "records": len(self.records), "sha1": digest}

    def check_resume(self, saved: dict, step: int, prompts_per_step: int) -> str | None:
        """Why a resume from ``saved`` (a ``data_state``) would not continue the same prompt stream; None if it
        does."""
        now = self.data_state(step, prompts_per_step)
        diff = [k for k in ("records", "sha1", "position") if saved.get(k) != now[k]]
        if not diff:
            return None
        return (f"the prompt stream differs from the checkpoint's ({', '.join(diff)} changed: saved {saved}, now "
                f"{now}); training goes on from position {now['position']} of the current dataset")


class Gsm8kTask(DatasetTask):
    name = "gsm8k"
    default_prompt_columns = ("question",)
    own_rewards = ("answer_match",)

    def __init__(self, job_config, tokenizer, dataset_path: str, dataset_split: str,
                 field_name: str = "rollout.dataset_path", reward_funcs: list[R.RewardFunc] | None = None):
        super().__init__(job_config, tokenizer, dataset_path, dataset_split, field_name, reward_funcs)
        # answer_match compares with each record's gold answer: without one a record can only ever score 0
        missing = [i for i, p in enumerate(self.records) if not R.gold_answer(p.answer)]
        col, where = job_config.rollout.answer_column, f"{field_name} = {dataset_path!r}"
        if len(missing) == len(self.records):
            raise ConfigError(f"{where}: no record has an answer in column {col!r} (rollout.answer_column) that "
                              "answer_match can compare (GSM8K's '... #### <number>', or the answer itself): every "
                              "reward would be 0; allowed: a dataset with answers, or the column that holds them")
        if missing:
            logger.warning(f"{where}: {len(missing)} of {len(self.records)} records (the first: record "
                           f"{missing[0]}) have no answer in column {col!r} that answer_match can compare; they "
                           "can only ever score 0")


# name -> factory(job_config, tokenizer, dataset_path, dataset_split, field_name, reward_funcs)
TASKS: dict[str, Callable[..., Task]] = {
    "digits": lambda *_, reward_funcs: DigitsTask(reward_funcs),
    "arithmetic": lambda *_, reward_funcs: ArithmeticTask(reward_funcs),
    "dataset": DatasetTask,
    "gsm8k": Gsm8kTask,
}
DATASET_TASKS = ("dataset", "gsm8k")


def task_factory(name: str) -> Callable[..., Task]:
    """A built-in task's factory (``reasoning_gym:<name>`` too), or a user's (``"package.module:name"``, called
    without ``reward_funcs``)."""
    if name in TASKS:
        return TASKS[name]
    if name.startswith(REASONING_GYM):
        return lambda job_config, tokenizer, *_, reward_funcs: ReasoningGymTask(job_config, tokenizer, reward_funcs)
    if ":" in name:
        return import_spec("rollout.task", name)
    if name == "jsonl":
        raise ValueError("rollout.task = 'jsonl' was renamed: use 'dataset'")
    raise ValueError(f"rollout.task = {name!r} is not allowed; allowed: {' | '.join(TASKS)}, "
                     "'reasoning_gym:<name>' or 'package.module:name'")


RESERVED_COLUMNS = {"prompts", "completions", "completion_ids"}  # reward functions' own arguments (rewards.py)


def _refuse_non_text_prompts(values: list, column: str, where: str) -> None:
    """``ConfigError`` when a text prompt is not a string (it would be trained on as its ``str()``)."""
    bad = [i for i, v in enumerate(values) if not isinstance(v, str)]
    if bad:
        raise ConfigError(f"{where} record {bad[0]}: column {column!r} is {type(values[bad[0]]).__name__} "
                          f"{str(values[bad[0]])[:60]!r} ({len(bad)} of {len(values)} records are not text); allowed: "
                          "a string prompt in every record (a list of messages goes in rollout.messages_column)")


def _refuse_empty_prompts(values: list, column: str, where: str) -> None:
    """``ConfigError`` when a prompt is null, empty or blank text, or an empty message list."""
    empty = [i for i, v in enumerate(values) if v is None or (isinstance(v, (str, list)) and not v)
             or (isinstance(v, str) and not v.strip())]
    if empty:
        raise ConfigError(f"{where} record {empty[0]}: column {column!r} is {values[empty[0]]!r} ({len(empty)} of "
                          f"{len(values)} records have a null, empty or blank prompt); allowed: a non-empty prompt in every "
                          "record (remove or fill those records)")


def prompt_budget(job_config, longest: int) -> tuple[str, str]:
    """For ``data.filter_long``'s messages: where the prompt limit comes from, and what would hold a prompt of
    ``longest`` tokens."""
    r, seq_len = job_config.rollout, job_config.training.seq_len
    fix = f"training.seq_len >= {longest + r.max_new_tokens} (longest prompt + rollout.max_new_tokens)"
    if r.max_prompt_tokens:
        return (f"rollout.max_prompt_tokens = {r.max_prompt_tokens}",
                f"rollout.max_prompt_tokens >= {longest} with {fix}")
    return (f"training.seq_len - rollout.max_new_tokens = {seq_len} - {r.max_new_tokens} = "
            f"{seq_len - r.max_new_tokens} tokens (rollout.max_prompt_tokens = 0)", fix)


def max_prompt_tokens(job_config) -> int:
    """``rollout.max_prompt_tokens``, or what ``training.seq_len`` leaves after ``max_new_tokens`` when it is 0."""
    r = job_config.rollout
    return r.max_prompt_tokens or job_config.training.seq_len - r.max_new_tokens


def reward_funcs(rollout_cfg) -> list[R.RewardFunc]:
    """``rollout.reward_funcs`` (with ``reward_weights``, as validated); [] when none are named (the task's own then
    score)."""
    specs, weights = list(rollout_cfg.reward_funcs), list(rollout_cfg.reward_weights)
    out = []
    for spec, w in zip(specs, weights or [1.0] * len(specs)):
        fn = BUILTIN_REWARDS.get(spec) or import_spec("rollout.reward_funcs", spec)
        out.append(R.RewardFunc(spec.rpartition(":")[2], fn, float(w)))  # TRL names it by the function
    if len({f.name for f in out}) < len(out):
        out = [R.RewardFunc(spec, f.fn, f.weight) for spec, f in zip(specs, out)]
    return out


def episode_rewards(rollout_cfg, rewards: list[R.RewardFunc]) -> list[R.RewardFunc]:
    """What scores multi-turn episodes (``rollout.environment``): ``rewards`` (``rollout.reward_funcs``; a task's
    own rewards read single completions, so they are not used), then the sum of the environment's ``env_rewards``
    weighted by ``rollout.environment_reward_weight`` (left out at 0)."""
    weight = rollout_cfg.environment_reward_weight
    env = [R.RewardFunc(R.ENV_REWARD_NAME, R.environment_reward, float(weight))] if weight else []
    if not rewards and not env:
        raise ConfigError("rollout.environment_reward_weight = 0 and no rollout.reward_funcs: nothing scores the "
                          "episodes; allowed: a nonzero weight, or reward functions over the conversation")
    return [*rewards, *env]


def build_task(job_config, tokenizer, dataset_path: str | None = None, dataset_split: str | None = None,
               field_name: str = "rollout.dataset_path") -> Task:
    """The task named by ``rollout.task``, on ``dataset_path`` / ``dataset_split`` (default: the rollout's),
    scored by ``rollout.reward_funcs`` when set, else by its own."""
    r = job_config.rollout
    path = r.dataset_path if dataset_path is None else dataset_path
    split = r.dataset_split if dataset_split is None else dataset_split

    factory, rewards = task_factory(r.task), reward_funcs(r)
    args = (job_config, tokenizer, path, split, field_name)
    if r.task in TASKS or r.task.startswith(REASONING_GYM):
        task = factory(*args, reward_funcs=rewards)
    else:  # a user's factory (rollout.task = 'package.module:name'): its failure or hang names it, before any work
        try:
            task = call_with_deadline(f"rollout.task = {r.task!r}", factory, *args, timeout_s=r.task_timeout_seconds,
                                      field=TASK_TIMEOUT_FIELD, passthrough=(ConfigError,))
        except UserCodeError as e:
            raise ConfigError(str(e)) from None
    if not isinstance(task, Task):
        raise ConfigError(f"rollout.task = {r.task!r} returned {type(task).__name__}; allowed: a "
                          "torchtitan_flux.data.tasks.Task (prompts(seed, step, n) and its reward functions)")
    if rewards and task.reward_funcs is not rewards:  # a user's task: a copy scored by rollout.reward_funcs
        task = copy.copy(task)
        task.reward_funcs = rewards
    if r.environment:  # episodes: rollout.reward_funcs over the conversation and the environment's own rewards
        task = copy.copy(task)
        task.reward_funcs = episode_rewards(r, rewards)
    if not task.reward_funcs:
        raise ConfigError(f"rollout.task = {task.name!r} has no reward of its own; name one in rollout.reward_funcs")
    return task


def build_eval_task(job_config, tokenizer, task: Task) -> Task | None:
    """The held-out task of ``[eval]`` (None when evaluation is off): ``eval.dataset_path`` (or the rollout
    dataset's ``eval.split``) for dataset tasks; a generated task evaluates on prompts of its own held-out seed."""
    ev, r = job_config.eval, job_config.rollout
    if not (ev.every_steps or ev.at_start):
        return None
    if not isinstance(task, DatasetTask):
        return task
    if not ev.dataset_path and not os.path.isdir(r.dataset_path):
        raise ConfigError(f"eval needs a held-out set: set eval.dataset_path, or make rollout.dataset_path = "
                         f"{r.dataset_path!r} a folder / saved DatasetDict with split eval.split = {ev.split!r}")
    return build_task(job_config, tokenizer, ev.dataset_path or r.dataset_path, ev.split,
                      "eval.dataset_path" if ev.dataset_path else "rollout.dataset_path (eval.split)")


def check_rewards(task: Task, seed: int, timeout_s: float, max_new_tokens: int, task_timeout_s: float,
                  episodes: bool = False) -> None:
    """Score an empty completion of one prompt with every reward function, so that a function that fails, returns
    a bad value or runs past ``timeout_s`` stops the run before any engine starts (``RewardError``); the task's
    ``prompts`` is called (and checked) the same way first. ``episodes``: as a multi-turn episode's (an opening user
    message, one empty assistant turn, no environment rewards, ended "done")."""
    prompt = task_prompts(task, seed, 1, 1, max_new_tokens, task_timeout_s)
    scorer = R.RewardScorer(task.reward_funcs, timeout_s=timeout_s)
    try:
        prompts, completions, columns = R.reward_inputs(task, prompt, [""], 1)
        if episodes:
            prompts, completions = [[{"role": "user", "content": prompt[0].text}]], [[{"role": "assistant",
                                                                                      "content": ""}]]
            columns = {**columns, R.ENV_REWARDS_COLUMN: [[]], R.EPISODE_END_COLUMN: ["done"]}
        scorer.wait(scorer.submit(prompts, completions, [[]], columns))
    finally:
        scorer.close()


def prompt_tokenizer(job_config):
    """The tokenizer of ``model.hf_assets_path`` (torchtitan's), to measure prompts before the trainer builds its
    own."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    hf = job_config.hf_assets_path
    try:
        return HuggingFaceTokenizer(tokenizer_path=hf)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:  # torchtitan's json.load of tokenizer_config.json
        raise ConfigError(f"model.hf_assets_path = {hf!r}: tokenizer_config.json is not valid JSON ({e}); allowed: "
                          "the file as published (re-download it)") from None
    except Exception as e:  # the tokenizers library raises a plain Exception for a tokenizer.json it cannot parse
        raise ConfigError(f"model.hf_assets_path = {hf!r}: tokenizer.json cannot be loaded ({e}); allowed: a "
                          "tokenizers file as published (re-download it)") from None


# -- reasoning-gym's procedurally generated tasks (rollout.task = "reasoning_gym:<name>"; docs/data.md): the dataset
# named <name>, its config set from rollout.task_args and seeded from rollout.seed (ReasoningGymTask says how it draws,
# holds out and scores).

REASONING_GYM = "reasoning_gym:"
TASK_ARGS_FIELD = "rollout.task_args"
MAX_REDRAWS = 100  # a training slot whose draws are all held out or too long refuses the task


@dataclass
class ReasoningGymPrompting:
    """The ``rollout.task_args`` entries every reasoning-gym task takes beside its dataset's config fields."""

    system_prompt: str = "default"
    """Which of reasoning-gym's system prompts (``reasoning_gym.utils.SYSTEM_PROMPTS``) opens each prompt; each
    asks for the answer between ``<answer>`` and ``</answer>``."""

    examples: int = 0
    """Solved items of the dataset (of a seed of their own) put before the question as earlier user / assistant
    turns, each answer written ``<answer>...</answer>``: they show a small model the answer format."""


def reasoning_gym():
    """The ``reasoning_gym`` package, or a one-line ``ConfigError`` naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError("rollout.task = 'reasoning_gym:...' needs the reasoning-gym package; install the extra: "
                          "pip install '.[tasks]' (or pip install reasoning-gym)") from None
    return reasoning_gym


def reasoning_gym_config(task: str, task_args: list[str]) -> tuple[str, Any, ReasoningGymPrompting]:
    """The dataset name of ``rollout.task = task``, its config set from ``task_args`` (checked; ``seed`` comes from
    ``rollout.seed``) and the prompting ``task_args`` set; ``ConfigError`` naming ``rollout.task`` or
    ``rollout.task_args`` with the allowed values."""
    reasoning_gym()
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS

    name = task.removeprefix(REASONING_GYM)
    if name not in DATASETS:
        raise ConfigError(f"rollout.task = {task!r}: reasoning-gym has no dataset {name!r}; allowed: "
                          f"'reasoning_gym:<name>' with name one of {sorted(DATASETS)}")
    config_cls = DATASETS[name][1]
    prompting_names = {f.name for f in dataclasses.fields(ReasoningGymPrompting)}
    dataset_names = {f.name for f in dataclasses.fields(config_cls) if f.init} - {"seed"}
    for arg in task_args:
        key, eq, _ = arg.partition("=")
        if not eq or key.strip() not in prompting_names | dataset_names:
            raise ConfigError(f"{TASK_ARGS_FIELD} has {arg!r}; allowed: 'name=value' with name one of "
                              f"{sorted(dataset_names)} (reasoning-gym's {config_cls.__name__}; seed comes from "
                              f"rollout.seed) or {sorted(prompting_names)}")
    mine = [a for a in task_args if a.partition("=")[0].strip() in prompting_names]
    prompting = ReasoningGymPrompting(**config_args(ReasoningGymPrompting, mine, TASK_ARGS_FIELD,
                                                    "the reasoning-gym task"))
    if prompting.system_prompt not in SYSTEM_PROMPTS:
        raise ConfigError(f"{TASK_ARGS_FIELD} sets system_prompt = {prompting.system_prompt!r}; allowed: one of "
                          f"{sorted(SYSTEM_PROMPTS)} (reasoning_gym.utils.SYSTEM_PROMPTS)")
    if prompting.examples < 0:
        raise ConfigError(f"{TASK_ARGS_FIELD} sets examples = {prompting.examples}; allowed: 0 or more")
    values = config_args(config_cls, [a for a in task_args if a not in mine], TASK_ARGS_FIELD,
                         f"reasoning-gym dataset {name}")
    try:
        config = config_cls(**values)
        if hasattr(config, "validate"):
            config.validate()
    except Exception as e:  # noqa: BLE001 - reasoning-gym's validate() asserts: its message names the rule
        raise ConfigError(f"{TASK_ARGS_FIELD} = {task_args}: reasoning-gym's {config_cls.__name__} refuses it "
                          f"({type(e).__name__}: {e})") from None
    return name, config, prompting


class ReasoningGymTask(Task):
    """A reasoning-gym dataset as a task. Training draws the ``size`` items of the training seed (``rollout.seed``)
    in seeded epochs, as a local dataset's records, redrawing any whose question is held out or whose prompt does not
    fit ``training.seq_len``; each draw is a function of (seed, step), so a resumed run draws what the uninterrupted
    one would have. The held-out set is the first ``eval.num_prompts`` items (64 when 0) of a second seed, the
    examples (``task_args`` ``examples``) those of a third (most reasoning-gym datasets seed item ``i`` with
    ``seed + i``: each seed starts past the items of the one before). A prompt is reasoning-gym's system prompt, the
    examples, then the question (chat-templated with ``rollout.apply_chat_template``, else as plain text); the reward
    (``score_answer``) is the dataset's own ``score_answer`` of what ``reasoning_gym.utils.extract_answer`` finds in
    the completion: the text of its last ``<answer>...</answer>`` element, or None without one (which scores 0 on
    most datasets, 0.01 on a few: ``countdown``, ``puzzle24``, ``fraction_simplification``)."""

    def __init__(self, job_config, tokenizer, reward_funcs: list[R.RewardFunc] | None = None):
        r = job_config.rollout
        self.dataset_name, self.config, self.prompting = reasoning_gym_config(r.task, list(r.task_args))
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS

        self.name = r.task
        self.dataset_cls = DATASETS[self.dataset_name][0]
        self.system_prompt = SYSTEM_PROMPTS[self.prompting.system_prompt]
        self.chat = bool(r.apply_chat_template)  # chat-templated prompts: rewards get TRL's conversational format
        self.template = ChatTemplate(job_config.hf_assets_path) if self.chat else None
        self.tokenizer, self.max_prompt_tokens = tokenizer, max_prompt_tokens(job_config)
        self.budget = prompt_budget(job_config, 0)[0]
        self.held_out_count = job_config.eval.num_prompts or 64
        self._seeded(r.seed)
        super().__init__(reward_funcs or [R.RewardFunc("score_answer", self.score_answer)])
        longest = max(self.eval_prompts(r.seed, 0), key=self._tokens)
        if self._tokens(longest) > self.max_prompt_tokens:
            raise ConfigError(f"rollout.task = {self.name!r}: the held-out prompt of "
                              f"{longest.columns['question']!r:.60} has {self._tokens(longest)} tokens, more than "
                              f"{self.budget}; allowed: an easier {TASK_ARGS_FIELD} setting, fewer examples, a "
                              "shorter system_prompt, or a larger training.seq_len")

    def _seeded(self, seed: int) -> None:
        """The training, held-out and example datasets of ``seed`` (the class docstring)."""
        self.seed, size = seed, self.config.size
        held_size = max(size, self.held_out_count)
        self.train = self.dataset_cls(config=dataclasses.replace(self.config, seed=seed))
        self.held_out = self.dataset_cls(config=dataclasses.replace(self.config, seed=seed + size, size=held_size))
        shown = self.dataset_cls(config=dataclasses.replace(self.config, seed=seed + size + held_size,
                                                            size=max(size, self.prompting.examples)))
        self.examples = [shown[i] for i in range(self.prompting.examples)]
        self.held_out_questions = {self.held_out[i]["question"] for i in range(self.held_out_count)}
        self.sampler = EpochSampler(size, seed)

    def _prompt(self, entry: dict) -> Prompt:
        messages = [{"role": "system", "content": self.system_prompt}]
        for e in self.examples:
            messages += [{"role": "user", "content": e["question"]},
                         {"role": "assistant", "content": f"<answer>{e['answer']}</answer>"}]
        messages.append({"role": "user", "content": entry["question"]})
        columns = {"question": entry["question"], "entry": entry}
        if self.template is None:
            text = "\n\n".join(m["content"] for m in messages) + "\n"
            return Prompt(text, str(entry["answer"]), columns)
        return Prompt(self.template.render(messages, add_generation_prompt=True), str(entry["answer"]), columns,
                      messages, add_bos=False)

    def _tokens(self, prompt: Prompt) -> int:
        return len(self.tokenizer.encode(prompt.text, add_bos=prompt.add_bos, add_eos=False))

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        if seed != self.seed:
            self._seeded(seed)
        out = []
        for position in range((step - 1) * n, step * n):
            index = self.sampler.indices(position, 1)[0]
            redraw = random.Random(f"{seed}:{position}")  # a function of the slot: a resume redraws alike
            for _ in range(MAX_REDRAWS):
                entry = self.train[index]
                prompt = self._prompt(entry)
                fits = self._tokens(prompt) <= self.max_prompt_tokens
                if fits and entry["question"] not in self.held_out_questions:
                    break
                index = redraw.randrange(self.config.size)
            else:
                raise ConfigError(f"rollout.task = {self.name!r}: {MAX_REDRAWS} draws for training prompt {position} "
                                  f"were all held out or longer than {self.budget}; allowed: {TASK_ARGS_FIELD} with "
                                  "a larger size or an easier setting, or a larger training.seq_len")
            out.append(prompt)
        return out

    def eval_prompts(self, seed: int, n: int) -> list[Prompt]:
        if seed != self.seed:
            self._seeded(seed)
        return [self._prompt(self.held_out[i]) for i in range(min(n or self.held_out_count, self.held_out_count))]

    def score_answer(self, prompts: list, completions: list, entry: list[dict], **_: Any) -> list[float]:
        """reasoning-gym's scoring: the dataset's ``score_answer`` of the completion's last ``<answer>`` element."""
        from reasoning_gym.utils import extract_answer

        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(self.train.score_answer(extract_answer(t), e)) for t, e in zip(texts, entry)]

    def data_state(self, step: int, prompts_per_step: int) -> dict:
        """What a checkpoint records of the draw after ``step``: the dataset, its config, the prompting, a hash of the
        held-out prompts (another reasoning-gym version may generate others) and the draw's position."""
        held = "\x00".join(json.dumps([p.text, p.answer]) for p in self.eval_prompts(self.seed, 0))
        config = json.dumps(dataclasses.asdict(self.config), sort_keys=True, default=str)
        return {"task": self.name, "config": config, "prompting": dataclasses.asdict(self.prompting),
                "held_out_sha1": hashlib.sha1(held.encode()).hexdigest(), "position": step * prompts_per_step}

    def check_resume(self, saved: dict, step: int, prompts_per_step: int) -> str | None:
        """Why a resume from ``saved`` (a ``data_state``) would not continue the same draw; None if it does."""
        now = self.data_state(step, prompts_per_step)
        diff = [k for k in now if saved.get(k) != now[k]]
        if not diff:
            return None
        return (f"the reasoning-gym draw differs from the checkpoint's ({', '.join(diff)} changed: saved {saved}, "
                f"now {now}); training goes on from position {now['position']} of the current one")
