"""A character tokenizer for the synthetic tasks.

Same interface as the `tokenizers`-backed one in `hf_tokenizer.py`: `vocab_size`,
`pad_id`, `bos_id`, `eos_id`, `encode(text)`, `decode(ids)`, and `tok`, the same tokenizer as
a `tokenizers.Tokenizer` (what the Hugging Face export writes as tokenizer.json). The thinking
markers are single tokens so the sampler can watch for the end of thinking.
"""

from __future__ import annotations

import functools

SPECIALS = ("<pad>", "<bos>", "<eos>", "<think>", "</think>")
CHARS = "0123456789+-*=()., abcdefghijklmnopqrstuvwxyz?!'"


class CharTokenizer:
    def __init__(self):
        self.vocab = list(SPECIALS) + list(CHARS)
        # Round up to 64 ids: unused ids decode to a visible marker, never to a crash.
        self.vocab += [f"<unused{i}>" for i in range(64 - len(self.vocab))]
        self.ids = {tok: i for i, tok in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.think_id, self.think_end_id = 3, 4
        self.vocab_size = len(self.vocab)

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            for special in SPECIALS:
                if text.startswith(special, i):
                    out.append(self.ids[special])
                    i += len(special)
                    break
            else:
                char = text[i].lower()
                if char not in self.ids:
                    raise ValueError(f"tokenizer: character {text[i]!r} at offset {i} of {text!r} is not in the vocabulary")
                out.append(self.ids[char])
                i += 1
        return out

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids if int(i) != self.pad_id)

    @functools.cached_property
    def tok(self):
        """This tokenizer as a `tokenizers.Tokenizer`: specials matched whole before the text is
        lower-cased, then one token per character; nothing added around the text (the prompts
        carry their <bos>); decoding concatenates. A character outside the vocabulary is an
        error here too (WordLevel without an unknown token)."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

        tok = Tokenizer(models.WordLevel(dict(self.ids), unk_token=None))
        tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens([AddedToken(s, normalized=False) for s in ("<pad>", "<bos>", "<eos>")])
        # <think> and </think> are part of the answer format, not control tokens: decode keeps them.
        tok.add_tokens([AddedToken(s, normalized=False, special=False) for s in ("<think>", "</think>")])
        return tok
