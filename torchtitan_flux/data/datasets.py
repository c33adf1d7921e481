"""Prompt datasets: local files through HF ``datasets``, chat templates, prompt-length filtering, epoch sampling.

* ``load_table``: a ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` file, a folder of such files (splits named by
  the file names), or a ``save_to_disk`` folder; local paths only. A ``.jsonl`` file is checked line by line first
  (``datasets`` takes bytes that are not UTF-8 silently and names no line in a syntax error).
* ``ChatTemplate``: the model folder's own ``chat_template``, rendered the way ``transformers``'
  ``apply_chat_template`` renders it (docs/data.md), tools included (multi-turn episodes, docs/environments.md).
  Simplification: no documents / ``{% generation %}`` blocks.
* ``EpochSampler``: record ``i`` of the prompt stream is ``perm(seed, i // N)[i % N]``, a fresh seeded permutation
  per epoch. The position is ``(step - 1) * prompts_per_step``, a function of the checkpointed step, so a resume
  mid-epoch draws exactly the prompts the uninterrupted run would have (no dataloader state).
"""

from __future__ import annotations

import json
import logging
import os
import random
from datetime import datetime
from typing import Any

from torchtitan_flux.errors import ConfigError

logger = logging.getLogger("torchtitan_flux")

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_table(path: str, split: str, field_name: str = "rollout.dataset_path"):
    """A ``datasets.Dataset`` from a local file or folder; ``split`` picks one split of a folder or a
    ``DatasetDict`` (a single file ignores it)."""
    import datasets

    if not os.path.exists(path):
        raise ConfigError(f"{field_name} = {path!r} does not exist; allowed: a .jsonl/.json/.parquet/.csv file, "
                         "a folder of them, or a save_to_disk folder")
    datasets.disable_progress_bars()
    if os.path.isdir(path):
        saved = any(os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "dataset_dict.json", "state.json"))
        files = [] if saved else sorted(os.listdir(path))
        meta = {"dataset_infos.json", "dataset_dict.json", "state.json", "dataset_info.json"}  # not data files
        exts = {os.path.splitext(n)[1].lower() for n in files if n not in meta} & set(_BUILDERS)
        if len({_BUILDERS[e] for e in exts}) > 1:  # the datasets library would read one kind and drop the others
            raise ConfigError(f"{field_name} = {path!r} mixes data files of types {sorted(exts)}; allowed: files of "
                              "one type in a folder")
        for name in files:
            if (check := _CHECKS.get(os.path.splitext(name)[1].lower())) is not None:
                check(os.path.join(path, name), field_name)
        table = _load(lambda: datasets.load_from_disk(path) if saved else datasets.load_dataset(path), path,
                      field_name)
    else:
        ext = os.path.splitext(path)[1].lower()
        if ext not in _BUILDERS:
            raise ConfigError(f"{field_name} = {path!r}: unknown file type {ext!r}; allowed: "
                             f"{' | '.join(sorted(_BUILDERS))}, or a folder")
        if ext in _CHECKS:
            _CHECKS[ext](path, field_name)
        table = _load(lambda: datasets.load_dataset(_BUILDERS[ext], data_files=path, split="train"), path,
                      field_name)
    if isinstance(table, datasets.DatasetDict):
        if split not in table:
            raise ConfigError(f"split {split!r} is not in {field_name} = {path!r}; it has {sorted(table)}")
        table = table[split]
    if len(table) == 0:
        raise ConfigError(f"{field_name} = {path!r} holds no records")
    return table


def _load(read, path: str, field_name: str):
    """``read()``, with the datasets library's errors as one ``ConfigError`` line naming the path."""
    try:
        return read()
    except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many kinds; the message is what matters
        root = e
        while (inner := root.__cause__ or root.__context__) is not None:  # DatasetGenerationError says only that
            root = inner
        why = " ".join(str(e).split())[:300] or type(e).__name__
        if root is not e:
            why += f" (from {type(root).__name__}: {' '.join(str(root).split())[:300]})"
        raise ConfigError(f"{field_name} = {path!r} cannot be read as a dataset ({type(e).__name__}: {why}); allowed: "
                          "a .jsonl/.json/.parquet/.csv file, a folder of files of one type, or a save_to_disk "
                          "folder") from None


def check_jsonl(path: str, field_name: str) -> None:
    """Every non-blank line of ``path`` is UTF-8 text holding one JSON object, and there is one at least;
    ``ConfigError`` naming the file and the (1-based) line otherwise."""
    records = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{field_name} = {path!r} line {n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where}: byte {raw[e.start]:#04x} at column {e.start + 1} is not UTF-8; allowed: "
                                  "UTF-8 text (re-encode the file)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"), object_pairs_hook=_unique_keys)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); allowed: one JSON object "
                                  "per line") from None
            except KeyError as e:  # the library failed with "Trailing data at position N"
                raise ConfigError(f"{where}: key {e.args[0]!r} appears twice in one object; allowed: each key "
                                  "once") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{where}: a JSON {type(record).__name__}; allowed: one JSON object per line")
            try:  # a lone \ud800-\udfff escape is valid JSON but no text: the library failed naming no line
                json.dumps(record, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise ConfigError(f"{where}: the escape {e.object[e.start]!r} is half of a UTF-16 surrogate pair, not "
                                  "text; allowed: valid Unicode (surrogate escapes only in pairs)") from None
            records += 1
    if not records:  # the datasets library says 'Instruction "train" corresponds to no data!'
        raise ConfigError(f"{field_name} = {path!r} holds no records (it is empty or only blank lines); allowed: one "
                          "JSON object per line")


def check_csv_header(path: str, field_name: str) -> None:
    """A CSV header names each column once (pandas renames a second ``prompt`` to ``prompt.1``, and the run would
    silently train on the first); ``ConfigError`` naming the file and the columns otherwise."""
    import csv

    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        header = next(csv.reader(f), [])
    if twice := sorted({c for c in header if header.count(c) > 1}):
        raise ConfigError(f"{field_name} = {path!r}: column(s) {twice} appear more than once in the header; "
                          "allowed: each column name once")


_CHECKS = {".jsonl": check_jsonl, ".csv": check_csv_header}  # what the datasets library reads without a word


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s object hook: ``KeyError(key)`` for a key given twice (json keeps the last silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise KeyError(k)
        out[k] = v
    return out


class ChatTemplate:
    """A model folder's chat template (see the module docstring)."""

    def __init__(self, model_dir: str):
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        cfg = {}
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ConfigError(f"model.hf_assets_path = {model_dir!r}: {cfg_path} is not valid JSON ({e})") from None
        source = cfg.get("chat_template")
        jinja_file = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(jinja_file):  # newer transformers save it beside tokenizer_config.json
            with open(jinja_file) as f:
                source = f.read()
        if isinstance(source, list):  # named templates: transformers uses "default"
            source = {t["name"]: t["template"] for t in source}.get("default")
        if not source:
            raise ConfigError(f"model.hf_assets_path = {model_dir!r} has no chat_template (in tokenizer_config.json or "
                             "chat_template.jinja); a 'messages' dataset or rollout.apply_chat_template = true needs one")
        self.special_tokens = {
            k: (v["content"] if isinstance(v, dict) else v)
            for k, v in cfg.items()
            if k.endswith("_token") and isinstance(v, (str, dict))
        }
        self.source = source
        self._template = _jinja_env().from_string(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """``tools``: JSON schemas as ``apply_chat_template`` takes them (``{"type": "function", ...}``)."""
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     **self.special_tokens)


def _jinja_env():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class EpochSampler:
    """Indices into N records, without replacement within an epoch (see the module docstring)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(self.n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            self._perms = {epoch: perm}  # keep one: positions only move forward
        return perm

    def indices(self, start: int, count: int) -> list[int]:
        """Indices of stream positions ``[start, start + count)``."""
        return [self._perm(i // self.n)[i % self.n] for i in range(start, start + count)]

    def epoch(self, position: int) -> int:
        return position // self.n


def filter_long(records: list[Any], lengths: list[int], max_tokens: int, policy: str, field_name: str,
                limit: str, fix: str) -> list[Any]:
    """Records whose prompt has at most ``max_tokens`` tokens; ``policy`` "drop" logs how many were dropped,
    "error" refuses the dataset. ``limit`` and ``fix`` are message parts (``tasks.prompt_budget``)."""
    keep = [r for r, n in zip(records, lengths) if n <= max_tokens]
    dropped = len(records) - len(keep)
    if dropped and policy == "error":
        first = next(i for i, n in enumerate(lengths) if n > max_tokens)
        raise ConfigError(
            f"{field_name}: {dropped} of {len(records)} prompts exceed {limit} (record {first} has {lengths[first]} "
            f"tokens, the longest {max(lengths)}); allowed: {fix}, or rollout.long_prompts = 'drop'"
        )
    if not keep:
        raise ConfigError(f"{field_name}: every prompt exceeds {limit} (the shortest has {min(lengths)} tokens); "
                          f"allowed: {fix}")
    if dropped:
        logger.warning(f"{field_name}: dropped {dropped} of {len(records)} prompts longer than {limit} (the longest "
                       f"has {max(lengths)} tokens; {fix} keeps them)")
    return keep
