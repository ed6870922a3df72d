"""A `tokenizers` (tokenizer.json) tokenizer with the interface of `tokenizer.CharTokenizer`:
`vocab_size`, `pad_id`, `bos_id`, `eos_id`, `think_id`, `think_end_id`, `encode(text)`,
`decode(ids)`.

Special tokens written in the text (e.g. "<|begin_of_text|>", "</think>") encode to their
single ids, as in the char tokenizer; `encode` adds nothing by itself (the prompt templates
carry their own BOS). `decode` drops pad ids only (none when pad is EOS), so "</think>" and EOS stay
visible to the verifiers.

Special ids are taken from the arguments, else from a `tokenizer_config.json` /
`special_tokens_map.json` next to the tokenizer.json (HF checkpoints), else from common names
(<|begin_of_text|>, <s>, <bos>, ...). A tokenizer without a pad token pads with EOS: pads are
masked everywhere they matter.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from rl_scaling import paths

_BOS = ("<|begin_of_text|>", "<bos>", "<s>", "<|startoftext|>", "[BOS]")
_EOS = ("<|eot_id|>", "<|end_of_text|>", "<|eot|>", "<eos>", "</s>", "<|endoftext|>", "[EOS]")
_PAD = ("<|finetune_right_pad_id|>", "<|finetune_right_pad|>", "<pad>", "[PAD]", "<|pad|>")


def _token_name(value):
    if isinstance(value, dict):  # {"content": "<s>", ...} in tokenizer_config.json
        return value.get("content")
    return value


class HFTokenizer:
    def __init__(self, path: str, *, bos: str | None = None, eos: str | None = None, pad: str | None = None,
                 think: str = "<think>", think_end: str = "</think>"):
        """`path` is a tokenizer.json or a directory holding one, local or gs://."""
        file = paths.join(path, "tokenizer.json") if paths.isdir(path) else paths.resolve(path)
        if not paths.isfile(file):
            raise FileNotFoundError(f"tokenizer: no tokenizer.json at {path}")
        self.path = file
        self.tok = Tokenizer.from_str(paths.read_text(file))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        named = self._named_specials(paths.dirname(file))
        self.bos_id = self._find("bos", bos or named.get("bos_token"), _BOS)
        self.eos_id = self._find("eos", eos or named.get("eos_token"), _EOS)
        pad_id = self._find("pad", pad or named.get("pad_token"), _PAD, required=False)
        self.pad_id = self.eos_id if pad_id is None else pad_id
        self.think_id = self.tok.token_to_id(think)
        self.think_end_id = self.tok.token_to_id(think_end)

    @staticmethod
    def _named_specials(folder):
        named = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            f = paths.join(folder, name)
            if paths.exists(f):
                data = json.loads(paths.read_text(f))
                for key in ("bos_token", "eos_token", "pad_token"):
                    if data.get(key) and key not in named:
                        named[key] = _token_name(data[key])
        return named

    def _find(self, what, explicit, candidates, required=True):
        if explicit is not None:
            idx = self.tok.token_to_id(explicit)
            if idx is None:
                raise ValueError(f"tokenizer {self.path}: {what} token {explicit!r} is not in the vocabulary")
            return idx
        for name in candidates:
            idx = self.tok.token_to_id(name)
            if idx is not None:
                return idx
        if required:
            raise ValueError(
                f"tokenizer {self.path}: no {what} token found (tried {candidates}); pass {what}=... explicitly"
            )
        return None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.pad_id != self.eos_id:  # padding with EOS: keep them, EOS must stay visible
            ids = [i for i in ids if i != self.pad_id]
        return self.tok.decode(ids, skip_special_tokens=False)
