"""A character tokenizer for the synthetic tasks.

Same interface as the `tokenizers`-backed one in `hf_tokenizer.py`: `vocab_size`,
`pad_id`, `bos_id`, `eos_id`, `encode(text)`, `decode(ids)`. The thinking markers are
single tokens so the sampler can watch for the end of thinking.
"""

from __future__ import annotations

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
