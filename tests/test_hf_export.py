"""The exported policy in the stock Hugging Face tools: AutoTokenizer encodes the task's prompts
to the ids the run trained on (the prompt text carries its BOS; nothing is added), and
AutoModelForCausalLM.generate (greedy) from the exported directory alone stops at <eos> with the
project sampler's tokens at near-zero temperature on held-out prompts."""

import json
import os

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from launch import convert  # noqa: E402
from rl_scaling import config as config_lib, train  # noqa: E402
from rl_scaling.policy import hf_export  # noqa: E402
from rl_scaling.rollout import collect  # noqa: E402
from rl_scaling.tasks import ArithmeticTask, arithmetic  # noqa: E402
from rl_scaling.tasks.hf_tokenizer import HFTokenizer  # noqa: E402
from rl_scaling.tasks.tokenizer import CharTokenizer  # noqa: E402
from tests.test_run import fast_config  # noqa: E402

CHAR = CharTokenizer()


def _auto_tokenizer(tokenizer, path):
    hf_export.save_hf_tokenizer(tokenizer, str(path))
    return transformers.AutoTokenizer.from_pretrained(str(path))


def test_char_tokenizer_files_give_the_task_ids(tmp_path):
    auto = _auto_tokenizer(CHAR, tmp_path)
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (CHAR.bos_id, CHAR.eos_id, CHAR.pad_id)
    assert len(auto) == CHAR.vocab_size
    task = ArithmeticTask(seed=0)
    problems = arithmetic.eval_problems(64) + [task.train_problem(i) for i in range(64)]
    for p in problems:
        completion = task.reference_completion(p)
        assert auto(p.prompt).input_ids == CHAR.encode(p.prompt), p.prompt  # one <bos>, from the text
        assert auto(p.prompt + completion).input_ids == CHAR.encode(p.prompt + completion)
        ids = CHAR.encode(p.prompt + completion)
        assert auto.decode(ids) == CHAR.decode(ids)  # <think>, </think> and <eos> stay visible
    assert auto("12+3=").input_ids == CHAR.encode("12+3=")  # no BOS added, as the project's encode
    assert auto("What Is 7*8?").input_ids == CHAR.encode("What Is 7*8?")  # lower-cased alike
    assert auto.decode(CHAR.encode("<bos>12+3=<think>51</think>51<eos>"), skip_special_tokens=True) == \
        "12+3=<think>51</think>51"
    # Left padding, as the project's prompt batches.
    batch = auto(["<bos>1+2=", "<bos>10+20="], padding=True).input_ids
    assert batch[0] == [CHAR.pad_id] * 2 + CHAR.encode("<bos>1+2=")


def test_hf_tokenizer_copy_adds_no_bos_and_keeps_its_config(tmp_path):
    """A Llama-style tokenizer.json whose post-processor prepends BOS: the run encoded prompts
    without it (its template writes the BOS), so the export drops the post-processor."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|finetune_right_pad_id|>", "<|begin_of_text|>", "<|eot_id|>", "<think>", "</think>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["What is 12 + 35? Let me think step by step.", "The answer is \\boxed{47}."] * 5, trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1)])])
    src = tmp_path / "src"
    src.mkdir()
    tok.save(str(src / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "chat_template": template}))
    run_tok = HFTokenizer(str(src / "tokenizer.json"))
    prompt = "<|begin_of_text|>What is 12 + 35?\nPlease reason step by step.<think>"
    assert tok.encode(prompt).ids[:2] == [1, 1]  # the source tokenizer alone would double the BOS

    auto = _auto_tokenizer(run_tok, tmp_path / "out")
    assert auto(prompt).input_ids == run_tok.encode(prompt)
    assert auto(prompt).input_ids.count(run_tok.bos_id) == 1
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (1, 2, 0)
    assert auto.chat_template == template


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A real run (150 warm-start steps teach the answer format and <eos>, one RL step) exported
    with launch/convert.py."""
    root = tmp_path_factory.mktemp("hf_export")
    config = fast_config(steps=1, eval_every=1, checkpoint_every=1, log_every=1)
    config.warmstart.max_steps = config.warmstart.eval_every = 150

    train.train(config, str(root / "run"))
    convert.main(["export", str(root / "run"), str(root / "hf")])
    return str(root / "run"), str(root / "hf"), config


@pytest.mark.slow
def test_generate_stops_at_eos_with_the_project_sampler_tokens(exported):
    workdir, out, config = exported
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert os.path.exists(os.path.join(out, name)), name
    auto = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (1, 2, 0)
    gen = model.generation_config  # generate()'s defaults: the run's sampler
    assert (gen.eos_token_id, gen.pad_token_id, gen.do_sample, gen.top_k) == (2, 0, True, 0)
    assert (gen.temperature, gen.max_new_tokens) == (config.rollout.temperature, config.rollout.max_new_tokens)

    problems = arithmetic.eval_problems(32)  # held out: training never drew them
    prompts = [p.prompt for p in problems]
    enc = auto(prompts, return_tensors="pt", padding=True)
    T = config.rollout.max_new_tokens
    with torch.no_grad():
        res = model.generate(**enc, do_sample=False, max_new_tokens=T, return_dict_in_generate=True, output_logits=True)
    theirs = res.sequences[:, enc.input_ids.shape[1]:].numpy()
    logits = torch.stack(res.logits, 1).numpy()  # [B, steps, V]

    # The project's sampler through its rollout collector at near-zero temperature: the argmax
    # wherever the top-2 logit gap dwarfs the Gumbel noise x temperature.
    params, cfg, _ = convert.run_params(workdir)
    gen_cfg = config_lib.model_config(config, config.rollout.fp32_lm_head)
    assert gen_cfg.vocab_size == cfg.vocab_size
    _, _, ours, _, _ = collect.generate(jax.device_get(params), gen_cfg, ArithmeticTask(0), problems, 1,
                                        jax.random.key(0), max_prompt_len=config.task.max_prompt_len,
                                        max_new_tokens=T, temperature=1e-6)
    compared = stopped = 0
    for i in range(len(problems)):
        n = int(ours.lengths_B[i])
        mine = ours.tokens_BT[i, :n].tolist()
        top2 = np.sort(logits[i], axis=-1)[:, -2:]
        gaps = top2[:, 1] - top2[:, 0]
        differ = [t for t in range(min(n, len(gaps))) if theirs[i, t] != mine[t]]
        upto = differ[0] + 1 if differ else n
        if gaps[:upto].min() <= 1e-3:  # a near tie up to where they part: undecidable in float32
            continue
        compared += 1
        assert theirs[i, :n].tolist() == mine, (prompts[i], theirs[i].tolist(), mine)
        if mine[-1] == CHAR.eos_id:  # stopped: nothing but padding after <eos>
            stopped += 1
            assert n < T and (theirs[i, n:] == CHAR.pad_id).all(), theirs[i].tolist()
        assert auto.decode(theirs[i, :n]) == CHAR.decode(mine)
    print(f"{compared} of {len(problems)} held-out prompts compared, {stopped} ended at <eos>")
    assert compared >= 3 * len(problems) // 4, f"{len(problems) - compared} of {len(problems)} prompts had near ties"
    assert stopped == compared, f"only {stopped} of {compared} completions ended at <eos>"
    assert len(res.logits) < T  # generation ended once every row had stopped
