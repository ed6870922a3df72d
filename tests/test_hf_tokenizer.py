"""HFTokenizer over a tokenizer.json trained here (BPE on a few lines)."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rl_scaling.tasks.hf_tokenizer import HFTokenizer

LINES = [
    "What is 12 + 35? Let me think step by step.",
    "The answer is \\boxed{47}.",
    "Compute the sum of the first 10 positive integers: 55.",
    "If x + 3 = 7 then x = 4, so the answer is 4.",
] * 5
SPECIALS = ["<pad>", "<s>", "</s>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(LINES, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    return path


def test_interface_and_round_trip(tok_dir):
    t = HFTokenizer(str(tok_dir))
    assert (t.pad_id, t.bos_id, t.eos_id, t.think_id, t.think_end_id) == (0, 1, 2, 3, 4)
    assert t.vocab_size == Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size()
    text = "<s>What is 12 + 35?<think>12 + 35 = 47</think>\\boxed{47}</s>"
    ids = t.encode(text)
    assert ids[0] == t.bos_id and ids[-1] == t.eos_id and t.think_end_id in ids
    assert all(isinstance(i, int) and 0 <= i < t.vocab_size for i in ids)
    assert t.decode(ids) == text
    assert t.decode([t.pad_id] * 3 + ids + [t.pad_id]) == text  # pads vanish
    assert t.encode("unseen wörds ✓") and t.decode(t.encode("unseen wörds ✓")) == "unseen wörds ✓"


def test_specials_from_config_and_errors(tok_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<think>", "eos_token": {"content": "</think>"}}))
    t = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert (t.bos_id, t.eos_id, t.pad_id) == (3, 4, 0)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer(str(tok_dir), eos="<|eot_id|>")
    with pytest.raises(FileNotFoundError):
        HFTokenizer(str(tmp_path / "missing"))
