#!/usr/bin/env python
"""Build a tiny randomly initialised Llama-3 model folder (HF layout) with a byte-level tokenizer.

    python scripts/build_tiny_model.py [--out DIR] [--flavor tiny|small] [--seed N] [--chat-out CHAT_DIR]

Default DIR is ``assets/tiny-llama`` under the repository root (gitignored). Idempotent: an existing
folder built with the same flavor and seed is left untouched. Prints the folder and its parameter count.
``--chat-out`` also writes its chat variant there (a chat template and the stop ids that end a turn, for multi-turn
episodes: ``train_configs/debug_multiturn_cpu.toml`` reads ``assets/tiny-chat``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from model_assets import FLAVORS, build_chat_model_dir, build_model_dir, count_parameters  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO_ROOT / "assets" / "tiny-llama"), help="output folder")
    ap.add_argument("--flavor", default="tiny", choices=sorted(FLAVORS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat-out", help="also write the model's chat variant to this folder")
    args = ap.parse_args(argv)
    path = build_model_dir(args.out, flavor=args.flavor, seed=args.seed)
    print(f"model dir: {path.resolve()}")
    print(f"flavor: {args.flavor} seed: {args.seed} parameters: {count_parameters(path):,}")
    if args.chat_out:
        print(f"chat variant: {build_chat_model_dir(path, args.chat_out).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
