"""Write a small synthetic dataset in GSM8K's format: data/gsm8k_synthetic/{train,test}.jsonl.

    python scripts/make_gsm8k_synthetic.py [--out data/gsm8k_synthetic] [--train 2000] [--test 100] [--seed 0]

Each record is {"question": ..., "answer": "<worked solution>\\n#### <number>"}, like GSM8K, generated here (no
GSM8K text is copied). The problems are one-step additions of small numbers ("Ann has 2 pens. She gets 3 more.
How many pens?", answers 2..8) with short questions: easy enough that the repository's 279k-parameter
byte-level debug model shows a rising reward in a short CPU run. It measures the plumbing (dataset, chat-free
prompts, answer extraction, rewards, eval), not reasoning. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import os
import random

NAMES = ["Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Ida", "Jo", "Kim"]
ITEMS = ["pens", "cats", "cups", "eggs", "hats", "keys", "maps", "owls"]


def record(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, 4), rng.randint(1, 4)
    question = f"{name} has {a} {item}. Gets {b} more. How many?"
    return {"question": question, "answer": f"{name} has {a} + {b} = {a + b} {item}.\n#### {a + b}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "data", "gsm8k_synthetic"))
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--test", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    for split, n in (("train", args.train), ("test", args.test)):
        with open(os.path.join(args.out, f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                f.write(json.dumps(record(rng)) + "\n")
    print(f"wrote {args.train} train / {args.test} test records to {args.out}")


if __name__ == "__main__":
    main()
