"""A multi-turn environment for the tiny model's end-to-end runs (``rollout.environment =
"fakes.environments:DigitsEnv"``, tests/ on ``PYTHONPATH``).

``DigitsEnv``: the record's prompt opens the episode; each assistant turn gets "ok <n>" back until ``turns`` turns,
then the episode ends with ``env_rewards = {"digits": the last turn's fraction of digit characters}`` (the digits
task's reward, earned over a conversation). ``fault`` ("raise", "hang", "type") makes ``step`` fail from its
``fault_after``-th call in this process on (so a run has trained some steps first).

``SpawningEnv``: ``DigitsEnv`` that starts, on every step, a process it never waits for and one it orphans (a shell
that backgrounds a ``sleep`` and exits), appending their pids to the file ``$FLUX_TEST_PIDS``."""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from dataclasses import dataclass

from torchtitan_flux.data.environments import MessageEnv, MessageEnvInitOutput, MessageEnvStepOutput

_steps = itertools.count(1)  # step() calls in this process


class DigitsEnv(MessageEnv):
    @dataclass(kw_only=True, slots=True)
    class Config(MessageEnv.Config):
        turns: int = 2
        fault: str = ""
        fault_after: int = 0

    def __init__(self, config: Config, *, env_input: dict) -> None:
        self.config, self.prompt, self.n = config, env_input["prompt"], 0

    async def init(self) -> MessageEnvInitOutput:
        return MessageEnvInitOutput(init_prompt_messages=[{"role": "user", "content": self.prompt}])

    async def step(self, completion_message) -> MessageEnvStepOutput:
        self.n += 1
        if self.config.fault and next(_steps) >= self.config.fault_after:
            if self.config.fault == "raise":
                raise RuntimeError("the tool broke")
            if self.config.fault == "hang":
                while True:
                    time.sleep(1)
            return "done"  # the wrong type
        if self.n < self.config.turns:
            return MessageEnvStepOutput(env_messages=[{"role": "user", "content": f"ok {self.n}"}])
        text = completion_message["content"]
        return MessageEnvStepOutput(done=True, env_rewards={"digits": sum(c.isdigit() for c in text) / max(1, len(text))})


class SpawningEnv(DigitsEnv):
    async def step(self, completion_message) -> MessageEnvStepOutput:
        child = subprocess.Popen(["sleep", "300"])
        shell = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
        with open(os.environ["FLUX_TEST_PIDS"], "a") as f:
            f.write(f"{child.pid}\n{shell.stdout.strip()}\n")
        return await super().step(completion_message)
