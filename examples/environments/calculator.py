"""A calculator environment for multi-step arithmetic (docs/environments.md): the model may call a plain-text tool
and must answer with the right number.

Protocol (the system message tells the model; SmolLM2's template has no tool format, so the tool is plain text):
``CALC: <expression>`` (to the end of its line) in an assistant turn asks the calculator (``+ - * /``, parentheses,
integers); the environment replies ``= <value>`` as a user message and the episode goes on. ``ANSWER: <number>`` ends
the episode with ``env_rewards = {"correct": 1.0}`` when the number is the record's answer, else 0.0. A turn with
neither ends the episode with 0.0. The first of the two in a turn counts.

Records (``problems``): ``{"question": "What is 23 * 47 + 18 * 9?", "answer": "1243"}``: two products of two-digit
numbers and their sum or difference (``kind="two_products"``), or ``{"question": "What is 347 * 68?", ...}``: one
product of a three-digit and a two-digit number (``kind="product"``, two turns: the call and the answer, the shape
the README's real-model run trains on, short enough for 2 CPU cores); both beyond what a 135M model computes
reliably alone; the calculator makes each step one call. ``calculator_task`` and ``product_task`` serve them as a
task (``rollout.task``): fresh problems each step, a fixed held-out set for ``[eval]``; without
``rollout.environment`` the same task is the no-tool baseline (the question alone, scored by ``answer_match``).
"""

from __future__ import annotations

import ast
import operator
import random
import re
from dataclasses import dataclass
from fractions import Fraction

from torchtitan_flux.data.environments import Message, MessageEnv, MessageEnvInitOutput, MessageEnvStepOutput
from torchtitan_flux.data.tasks import Prompt, Task

SYSTEM = ("You solve arithmetic problems with a calculator. To use it, write one line 'CALC: <expression>', for "
          "example 'CALC: 12*37', and stop; it replies '= 444'. When you know the result, write 'ANSWER: <number>'.")

_CALL = re.compile(r"\b(CALC|ANSWER)\s*:[ \t]*([^\n]*)", re.I)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_DIGITS = 30  # a longer number is refused (products of long numbers would grow without bound)


class CalculatorEnv(MessageEnv):
    """One problem: the question in, calculator replies until an answer (the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MessageEnv.Config):
        examples: int = 0
        """Worked examples in the opening (a question, the calculator calls and their replies, the answer), for a
        model that does not follow the protocol from the system message alone (``rollout.environment_args =
        ["examples=1"]``)."""

    def __init__(self, config: Config, *, env_input: dict) -> None:
        self._question = env_input["question"]
        self._answer = Fraction(env_input["answer"])
        self._examples = config.examples

    async def init(self) -> MessageEnvInitOutput:
        kind = "product" if self._question.count("*") == 1 else "two_products"  # examples of the question's shape
        records = problems(self._examples, seed=EXAMPLE_SEED, kind=kind)
        shots = [m for record in records for m in worked_example(record)]
        return MessageEnvInitOutput(init_prompt_messages=[{"role": "system", "content": SYSTEM}, *shots,
                                                          {"role": "user", "content": self._question}])

    async def step(self, completion_message: Message) -> MessageEnvStepOutput:
        found = _CALL.search(completion_message["content"])
        if found is None:
            return MessageEnvStepOutput(done=True, env_rewards={"correct": 0.0})
        kind, text = found.group(1).upper(), found.group(2)
        if kind == "ANSWER":
            number = _NUMBER.match(text)
            correct = number is not None and Fraction(number.group(0).replace(",", "")) == self._answer
            return MessageEnvStepOutput(done=True, env_rewards={"correct": float(correct)})
        return MessageEnvStepOutput(env_messages=[{"role": "user", "content": calculate(text)}])


def worked_example(record: dict) -> list[Message]:
    """``record`` solved with the calculator, as messages: each product, then (two products) their sum or
    difference, then the answer."""
    terms = record["question"].removeprefix("What is ").removesuffix("?").replace("*", "").split()
    if len(terms) == 2:  # a product
        steps = ["{}*{}".format(*terms)]
    else:
        a, b, op, c, d = terms
        ab, cd = f"{a}*{b}", f"{c}*{d}"
        steps = [ab, cd, f"{calculate(ab)[2:]}{op}{calculate(cd)[2:]}"]
    out: list[Message] = [{"role": "user", "content": record["question"]}]
    for expr in steps:
        out += [{"role": "assistant", "content": f"CALC: {expr}"}, {"role": "user", "content": calculate(expr)}]
    return out + [{"role": "assistant", "content": f"ANSWER: {record['answer']}"}]


def calculate(expression: str) -> str:
    """``= <value>`` of an arithmetic expression, or ``= error: <why>``; never evaluates anything else."""
    try:
        value = _eval(ast.parse(expression.replace("×", "*").rstrip(" =?"), mode="eval").body)
    except SyntaxError:
        return "= error: not an expression"
    except ZeroDivisionError:
        return "= error: division by zero"
    except RecursionError:
        return "= error: too deeply nested"
    except ValueError as e:
        return f"= error: {e}"
    if value.denominator == 1:
        return f"= {value.numerator}"
    return f"= {float(value):.6g}"


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _bounded(_OPS[type(node.op)](_eval(node.left), _eval(node.right)))
    raise ValueError("only integers, + - * / and parentheses")


def _bounded(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_DIGITS:
        raise ValueError(f"a number beyond {MAX_DIGITS} digits")
    return value


PROBLEM_KINDS = ("two_products", "product")
# The worked examples' records: not a training step's seed (seed * 1_000_003 + step) nor the held-out set's (7_919)
# in a run seeded below 1000 (random.Random(-s) is random.Random(s): the -1 used before was step 1's).
EXAMPLE_SEED = 1_000_000_007


def problems(n: int, seed: int, kind: str = "two_products") -> list[dict]:
    """``n`` records ``{"question", "answer"}``: ``a * b + c * d`` or ``a * b - c * d`` with two-digit operands
    (``two_products``), or ``a * b`` with a three-digit ``a`` and a two-digit ``b`` (``product``)."""
    if kind not in PROBLEM_KINDS:
        raise ValueError(f"kind = {kind!r}; expected one of {PROBLEM_KINDS}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kind == "product":
            a, b = rng.randint(101, 999), rng.randint(11, 99)
            out.append({"question": f"What is {a} * {b}?", "answer": str(a * b)})
            continue
        a, b, c, d = (rng.randint(11, 99) for _ in range(4))
        op = rng.choice("+-")
        answer = a * b + c * d if op == "+" else a * b - c * d
        out.append({"question": f"What is {a} * {b} {op} {c} * {d}?", "answer": str(answer)})
    return out


class CalculatorTask(Task):
    """``problems`` as prompts: seeded by (seed, step); ``eval_prompts`` a fixed set (its own seed). The prompt's text
    is the question in the model's chat template (the baseline's prompt; an episode opens with ``init`` instead)."""

    name = "calculator"
    own_rewards = ("answer_match",)

    def __init__(self, template=None, kind: str = "two_products"):
        super().__init__()
        self.template = template
        self.kind = kind

    def _prompts(self, records: list[dict]) -> list[Prompt]:
        out = []
        for r in records:
            text = r["question"] if self.template is None else self.template.render(
                [{"role": "user", "content": r["question"]}], add_generation_prompt=True)
            out.append(Prompt(text, r["answer"], dict(r), add_bos=self.template is None))
        return out

    def prompts(self, seed: int, step: int, n: int) -> list[Prompt]:
        return self._prompts(problems(n, seed * 1_000_003 + step, self.kind))

    def eval_prompts(self, seed: int, n: int) -> list[Prompt]:
        return self._prompts(problems(n or 64, 7_919, self.kind))  # the same held-out records for every run and seed


def calculator_task(job_config, tokenizer, dataset_path, dataset_split, field_name,
                    kind: str = "two_products") -> CalculatorTask:
    """``rollout.task = "examples.environments.calculator:calculator_task"``: the model's chat template renders the
    baseline's prompts when the model folder has one."""
    from torchtitan_flux.data.datasets import ChatTemplate
    from torchtitan_flux.errors import ConfigError

    try:
        template = ChatTemplate(job_config.hf_assets_path)
    except ConfigError:  # no chat template: the question as plain text
        template = None
    return CalculatorTask(template, kind)


def product_task(job_config, tokenizer, dataset_path, dataset_split, field_name) -> CalculatorTask:
    """``rollout.task = "examples.environments.calculator:product_task"``: ``calculator_task`` with one product."""
    return calculator_task(job_config, tokenizer, dataset_path, dataset_split, field_name, kind="product")
