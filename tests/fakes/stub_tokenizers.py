"""Tokenizers for tests that need one without a tokenizer file (not named ``tokenizers.py``: run as a script,
sglang_server.py would import it instead of HF's ``tokenizers``)."""

from __future__ import annotations

import model_assets as assets


class ByteTokenizer:
    """The byte-level tokenizer of ``assets`` (token = BYTE_OFFSET + byte), enough for the scheduler."""

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        ids = [assets.BYTE_OFFSET + b for b in text.encode()]
        return ([assets.BOS_ID] if add_bos else []) + ids + ([assets.EOS_ID] if add_eos else [])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - assets.BYTE_OFFSET for i in ids if i >= assets.BYTE_OFFSET).decode(errors="replace")


class FakeTokenizer:
    """Every text is ``[1, 2, 3]``, every completion decodes to ``""``: enough to dispatch."""

    def encode(self, text, add_bos=True, add_eos=False):
        return [1, 2, 3]

    def decode(self, ids, skip_special_tokens=True):
        return ""
