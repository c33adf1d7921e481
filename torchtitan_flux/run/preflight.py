"""``preflight``: what is checked and loaded before torchtitan builds the model or any engine starts: the batch
against the trainer ranks, the model family, the task and its held-out set, the reward functions (called once on a
sample) and the resume's config fingerprint. Every failure is one ``ConfigError`` line naming the field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torchtitan_flux.data.tasks import build_eval_task, build_task, check_rewards, prompt_tokenizer
from torchtitan_flux.errors import ConfigError
from torchtitan_flux.models.families import model_spec
from torchtitan_flux.run import resume


@dataclass
class Preflight:
    task: Any
    eval_task: Any  # None without held-out evaluation
    fingerprint: dict[str, Any]
    checkpoint_folder: str
    config_changes: list[str]  # fields that differ from the checkpoint's (checkpoint.on_config_mismatch = "warn")


def preflight(job_config) -> Preflight:
    """Also sets ``job_config.model_spec``: the family of ``hf_assets_path/config.json``."""
    batch, world = job_config.rollout.prompts_per_step * job_config.grpo.group_size, int(os.environ.get("WORLD_SIZE", 1))
    if batch % world:
        raise ConfigError(f"rollout.prompts_per_step * grpo.group_size = {batch} must be divisible by the number of "
                          f"trainer ranks ({world})")
    try:  # the family in model.hf_assets_path/config.json picks the ModelSpec, or is refused here
        job_config.model_spec = model_spec(job_config.hf_assets_path)
    except ValueError as e:
        raise ConfigError(f"model.hf_assets_path = {job_config.hf_assets_path!r}: {e}") from None
    tokenizer = prompt_tokenizer(job_config)
    task = build_task(job_config, tokenizer)
    eval_task = build_eval_task(job_config, tokenizer, task)
    r = job_config.rollout
    check_rewards(task, r.seed, r.reward_timeout_seconds, r.max_new_tokens, r.task_timeout_seconds,
                  episodes=bool(r.environment))
    fp = resume.fingerprint(job_config, task)
    folder = os.path.join(job_config.dump_folder, job_config.checkpoint.folder)
    return Preflight(task, eval_task, fp, folder, resume.check_resume(job_config, fp, folder))
