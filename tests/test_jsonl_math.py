"""JSONL math dataset (loading, errors, split, task interface) and the sympy verifier."""

import json
import time

import pytest

from rl_scaling.tasks import jsonl_math
from rl_scaling.tasks.math_verify import extract_answer, strip_thinking, verify
from rl_scaling.tasks.tokenizer import CharTokenizer

ROWS = [{"problem": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1)} for i in range(200)]


def _write(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


def test_load_and_split_is_deterministic(tmp_path):
    path = _write(tmp_path / "a.jsonl", ROWS + [ROWS[0]], raw_lines=["", "   "])
    rows = jsonl_math.load_jsonl(path)
    assert len(rows) == 200 and rows[0] == ("What is 0 + 1?", "1")
    train, held = jsonl_math.split(rows, 0.1)
    assert len(train) + len(held) == 200 and 5 < len(held) < 40
    assert not {p for p, _ in train} & {p for p, _ in held}
    # independent of file order, and a problem's side never changes when rows are added
    path2 = _write(tmp_path / "b.jsonl", list(reversed(ROWS)) + [{"problem": "new one", "answer": "1"}])
    train2, held2 = jsonl_math.split(jsonl_math.load_jsonl(path2), 0.1)
    assert set(held) <= set(held2) and set(train) <= set(train2)
    assert jsonl_math.is_heldout("What  is 0 +\n1?", 0.1) == jsonl_math.is_heldout("What is 0 + 1?", 0.1)


@pytest.mark.parametrize("line,match", [
    ('{"problem": "1+1", "answer": "2"', "a.jsonl:3: invalid JSON"),
    ('{"question": "1+1", "answer": "2"}', "a.jsonl:3: missing field 'problem'"),
    ('{"problem": "1+1", "answer": "  "}', "a.jsonl:3: field 'answer' is empty"),
    ('{"problem": "1+1", "answer": null}', "a.jsonl:3: field 'answer' is empty"),
    ('{"problem": "", "answer": "2"}', "a.jsonl:3: field 'problem' must be a non-empty string"),
    ('[1, 2]', "a.jsonl:3: expected a JSON object"),
])
def test_malformed_rows_name_file_and_line(tmp_path, line, match):
    path = _write(tmp_path / "a.jsonl", ROWS[:2], raw_lines=[line])
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("[", r"\[")):
        jsonl_math.load_jsonl(path)


def test_custom_fields_and_numeric_answers(tmp_path):
    path = _write(tmp_path / "c.jsonl", [{"question": "q1", "solution": 3}, {"question": "q2", "solution": 0.5}])
    assert jsonl_math.load_jsonl(path, "question", "solution") == [("q1", "3"), ("q2", "0.5")]


def test_task_interface(tmp_path):
    path = _write(tmp_path / "a.jsonl", ROWS)
    task = jsonl_math.JsonlMathTask(path, CharTokenizer(), seed=3, heldout_fraction=0.1)
    first_epoch = [task.train_problem(i).key for i in range(len(task.train))]
    assert len(set(first_epoch)) == len(task.train)  # one epoch visits every problem once
    assert task.train_problem(5) == jsonl_math.JsonlMathTask(path, CharTokenizer(), seed=3, heldout_fraction=0.1).train_problem(5)
    held = task.eval_problems(3)
    assert {p.key for p in held}.isdisjoint(first_epoch)
    p = held[0]
    assert p.prompt.startswith("<bos>" + p.problem) and p.prompt.endswith("<think>")
    assert task.reward("<think>...</think>" + task.reference_completion(p).split("</think>")[1], p) == 1.0
    assert task.reward("<think>no idea</think> \\boxed{-1}", p) == 0.0
    with pytest.raises(ValueError, match="larger than the held-out set"):
        task.eval_problems(10_000)


CASES = [
    ("<think>hmm</think>The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1),
    ("<think>hmm</think>\\boxed{0.5}", "\\frac12", 1),
    ("<think>a</think>\\boxed{\\dfrac{3}{4}}", "0.75", 1),
    ("<think>a</think>\\boxed{2x+1}", "1+2x", 1),
    ("<think>a</think>\\boxed{2x+1}", "2x-1", 0),
    ("<think>a</think>\\boxed{1,000}", "1000", 1),
    ("<think>a</think>So there are 1,000,000 ways.", "10^6", 1),
    ("\\boxed{42}", "42", 0),  # thinking never ended
    ("<think>\\boxed{42}</think> so 41", "42", 0),  # a box inside the thinking does not count
    ("<think>x</think>So we get 42.", "42", 1),
    ("<think>x</think>\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sqrt{3}/2", 1),
    ("<think>x</think>\\boxed{x = 5}", "5", 1),
    ("<think>x</think>\\boxed{(1, 2)}", "(1,2)", 1),
    ("<think>x</think>\\boxed{(2, 1)}", "(1,2)", 0),
    ("<think>x</think>\\boxed{50\\%}", "50", 1),
    ("<think>x</think>\\boxed{\u22123}", "-3", 1),
    ("<think>x</think>\\boxed{\\pi/2}", "1.5707963", 1),
    ("<think>x</think>\\boxed{90^\\circ}", "90", 1),
    ("<think>x</think>\\boxed{12\\text{ cm}}", "12", 1),
    ("<think>x</think>\\boxed{\\sqrt[3]{8}}", "2", 1),
    ("<think>x</think>\\boxed{2^{10}}", "1024", 1),
    ("<think>x</think>\\boxed{\\text{(B)}}", "B", 1),
    ("<think>x</think>no numbers here", "3", 0),
    ("<think>x</think>The answer is: 7", "7", 1),
    ("<think>one</think><think>two</think> \\boxed{3}", "3", 1),
    ("<think>x</think>\\boxed{\\sin(x)^2+\\cos(x)^2}", "1", 1),
    # hostile output: never executed, never hangs
    ("<think>x</think>\\boxed{__import__('os').system('echo pwned')}", "0", 0),
    ("<think>x</think>\\boxed{9^{9^{9^9}}}", "1", 0),
]


@pytest.mark.parametrize("response,answer,want", CASES)
def test_verify(response, answer, want):
    start = time.time()
    assert verify(response, answer) == want
    assert time.time() - start < 5


def test_extraction_helpers():
    assert strip_thinking("no end") is None and strip_thinking("a</think>b</think>c") == "c"
    assert extract_answer("\\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert extract_answer("we get 3, then 4.5 and finally -7") == "-7"
    assert extract_answer("nothing") is None
