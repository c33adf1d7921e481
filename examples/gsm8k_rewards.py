"""Reward functions written the way TRL's documentation writes them (``GRPOTrainer(reward_funcs=[...])``), used
unchanged by train_configs/gsm8k_synthetic_cpu.toml: batched, the dataset's columns as keyword arguments.
"""

import re


def correctness_reward(completions, answer, **kwargs):
    """1.0 when the last number of the completion equals the number after '####' in the dataset's answer."""
    golds = [a.split("####")[-1].strip().replace(",", "") for a in answer]
    preds = [re.findall(r"-?\d+", c.replace(",", "")) for c in completions]
    return [1.0 if p and p[-1] == g else 0.0 for p, g in zip(preds, golds)]

