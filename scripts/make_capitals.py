"""Write the real-model task's dataset: data/capitals/{train,test}.jsonl ("What is the capital of X?").

    python scripts/make_capitals.py [--out data/capitals] [--test 40] [--seed 0]

One record per country: {"prompt": "What is the capital of France?", "answer": "Paris"}; the countries are split
at random (seeded) into train and a held-out test split, so evaluation asks about countries the run never trained
on. Why this task: SmolLM2-135M-Instruct knows many capitals (greedy, it names the right one for about two thirds
of them) but at the sampling temperature GRPO trains with (1.0) it rambles and names it in about a quarter of its
samples. Reward: ``examples/capital_rewards.py``. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from examples.capital_rewards import CAPITALS  # noqa: E402  (one list: the data and the reward agree)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/capitals")
    ap.add_argument("--test", type=int, default=40, help="held-out countries")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    countries = sorted(CAPITALS)
    random.Random(args.seed).shuffle(countries)
    splits = {"test": countries[: args.test], "train": countries[args.test :]}
    os.makedirs(args.out, exist_ok=True)
    for split, names in splits.items():
        with open(os.path.join(args.out, f"{split}.jsonl"), "w") as f:
            for c in names:
                f.write(json.dumps({"prompt": f"What is the capital of {c}?", "answer": CAPITALS[c]}) + "\n")
        print(f"{split}: {len(names)} records -> {args.out}/{split}.jsonl")


if __name__ == "__main__":
    main()
