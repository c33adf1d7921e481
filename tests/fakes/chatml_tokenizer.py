"""A small ChatML tokenizer folder, in SmolLM2-135M-Instruct's layout, for tests that need a chat template and a
real BPE tokenizer without the real model (that one is set up only for the slow and vLLM stages): special tokens
``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2 (the EOS) as in SmolLM2, SmolLM2's chat template, and a
byte-level BPE trained here on a few lines, so that merges exist (one token per character is not the canonical
tokenization) and every text encodes."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
IM_END = 2
CHAT_TEMPLATE = (  # SmolLM2-135M-Instruct's chat_template.jinja
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "system user assistant tool", "What is 23 * 47 + 18 * 9? CALC: 23*47 = 1081 CALC: 18*9 = 162 ANSWER: 1243",
    "Sort the words alphabetically: apple banana cherry. The answer is", "ok answer to turn guess again correct",
    "one two three short hi hello a much longer answer than four tokens",
]


def write_chatml_tokenizer(folder: Path) -> Path:
    """``folder`` with tokenizer.json, tokenizer_config.json, chat_template.jinja and config.json; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    assert [tok.token_to_id(t) for t in SPECIAL] == [0, 1, 2]
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
         "unk_token": "<|endoftext|>"}))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": IM_END, "pad_token_id": IM_END}))
    return folder
