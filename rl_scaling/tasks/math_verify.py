"""Math answer verification with sympy (the paper checks Polaris answers with sympy /
Math-Verify after stripping the thinking part).

  verify(response, answer) -> 1.0 or 0.0

1. Thinking is stripped: everything up to and including the last "</think>". A response with
   no "</think>" never finished thinking and gets 0.
2. The final answer is the content of the last \\boxed{...} (or \\fbox{...}) in what is left;
   failing that, what follows a last "answer is"/"answer:"; failing that, the last number.
3. Both sides are normalised (LaTeX -> sympy syntax: \\frac, \\sqrt, ^, \\cdot, \\pi, thousands
   separators "1,000", "x = 5" -> 5, percent and degree signs, \\text{units}) and compared:
   numerically (relative 1e-6) when both are constants, by simplify(a - b) == 0 otherwise,
   elementwise for tuples "(1, 2)", and as normalised strings when neither parses.

Model output reaches sympy's parser, which evaluates Python: text is parsed only if it is made
of digits, operators, brackets and whitelisted names, and huge powers are refused, so nothing
but arithmetic ever runs.
"""

from __future__ import annotations

import re

import sympy
from sympy.parsing.sympy_parser import (
    convert_xor,
    implicit_multiplication_application,
    parse_expr,
    standard_transformations,
)

_TRANSFORMS = standard_transformations + (implicit_multiplication_application, convert_xor)
_FUNCS = {"sqrt", "pi", "oo", "log", "ln", "exp", "sin", "cos", "tan", "E", "I"}
_SAFE = re.compile(r"^[0-9a-zA-Z+\-*/^().,\s]*$")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})+(?:\.\d+)?|-?\d*\.\d+|-?\d+(?:/\d+)?")
MAX_LEN = 200


def strip_thinking(response: str) -> str | None:
    """What follows the last </think>, or None if thinking never ended."""
    if "</think>" not in response:
        return None
    return response.rsplit("</think>", 1)[1]


def _braced(text: str, start: int) -> str | None:
    """Content of the {...} group opening at text[start] (balanced), or None."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return None


def last_boxed(text: str) -> str | None:
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*", text):
        content = _braced(text, m.end())
        if content is not None:
            best = content
    return best


def extract_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    m = list(re.finditer(r"answer\s*(?:is|:)\s*:?\s*(.+?)(?:\.\s|\.?$|\n)", text, flags=re.IGNORECASE))
    if m:
        return m[-1].group(1).strip().strip("$")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _replace_group_command(s: str, name: str, n_args: int, fmt) -> str:
    """Rewrite \\name{a}{b}... (also the \\frac12 shorthand) with fmt(*args)."""
    out, i = [], 0
    pat = "\\" + name
    while True:
        j = s.find(pat, i)
        if j < 0 or (j + len(pat) < len(s) and s[j + len(pat)].isalpha()):
            if j < 0:
                out.append(s[i:])
                return "".join(out)
            out.append(s[i:j + len(pat)])
            i = j + len(pat)
            continue
        out.append(s[i:j])
        k, args = j + len(pat), []
        for _ in range(n_args):
            while k < len(s) and s[k] == " ":
                k += 1
            if k < len(s) and s[k] == "{":
                arg = _braced(s, k)
                if arg is None:
                    return "".join(out) + s[j:]
                args.append(arg)
                k += len(arg) + 2
            elif k < len(s):  # \frac12: single-character arguments
                args.append(s[k])
                k += 1
        if len(args) < n_args:
            return "".join(out) + s[j:]
        out.append(fmt(*args))
        i = k


def normalize(expr: str) -> str:
    """LaTeX-ish answer -> a sympy-parsable string (best effort)."""
    s = expr.strip().replace("\u2212", "-").replace("\u00d7", "*").replace("\u00b7", "*")
    s = re.sub(r"\\[\(\)\[\]]|\$", "", s)
    for junk in (r"\left", r"\right", r"\displaystyle", r"\!", r"\,", r"\;", r"\:", "~"):
        s = s.replace(junk, "")
    s = re.sub(r"\^\s*\{?\\circ\}?|\\circ|\\%|%|\\degree", "", s)
    # \text{...}: units vanish, anything else keeps its content
    s = _replace_group_command(s, "text", 1, lambda a: "" if re.fullmatch(r"\s*[A-Za-z ]+\s*", a) else a)
    for cmd in ("mathrm", "textbf", "mathbf", "mbox"):
        s = _replace_group_command(s, cmd, 1, lambda a: a)
    for cmd in ("dfrac", "tfrac"):
        s = s.replace("\\" + cmd, "\\frac")
    s = _replace_group_command(s, "frac", 2, lambda a, b: f"(({a})/({b}))")
    s = re.sub(r"\\sqrt\s*\[([^\]]*)\]\s*\{", lambda m: "\\root{" + m.group(1) + "}{", s)
    s = _replace_group_command(s, "root", 2, lambda n, a: f"(({a})**(1/({n})))")
    s = _replace_group_command(s, "sqrt", 1, lambda a: f"sqrt({a})")
    for a, b in ((r"\cdot", "*"), (r"\times", "*"), (r"\div", "/"), (r"\pi", "pi"), (r"\infty", "oo"),
                 (r"\ln", "log"), (r"\log", "log"), (r"\exp", "exp"), (r"\sin", "sin"), (r"\cos", "cos"),
                 (r"\tan", "tan")):
        s = s.replace(a, b)
    s = s.replace("{", "(").replace("}", ")")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators
    s = s.strip().rstrip(".").strip()
    if "=" in s:  # "x = 5" -> "5"; "a = b = 7" -> "7"
        s = s.rsplit("=", 1)[1].strip()
    return s


def _safe_parse(s: str):
    if not s or len(s) > MAX_LEN or not _SAFE.match(s) or "__" in s:
        return None
    for name in re.findall(r"[A-Za-z_]+", s):
        if len(name) > 1 and name not in _FUNCS:
            return None
    if re.search(r"[A-Za-z]\s*\.|\.\s*[A-Za-z]", s):  # no attribute access
        return None
    powers = re.findall(r"(?:\*\*|\^)\s*\(?\s*(\d+)", s)
    if len(re.findall(r"\*\*|\^", s)) > 3 or any(len(p) > 3 for p in powers):
        return None
    try:
        lazy = parse_expr(s.replace("^", "**"), transformations=_TRANSFORMS, evaluate=False)
        if not _bounded(lazy):
            return None
        return parse_expr(s.replace("^", "**"), transformations=_TRANSFORMS, evaluate=True)
    except Exception:  # sympy raises many kinds on junk
        return None


def _bounded(expr) -> bool:
    """No tower of powers and no constant exponent above 1000 (9^9^9 would never finish).
    Reciprocals (x**-1, how an unevaluated division is written) are allowed anywhere."""
    for node in sympy.preorder_traversal(expr):
        if not isinstance(node, sympy.Pow) or node.exp == -1:
            continue
        if any(isinstance(n, sympy.Pow) and n.exp != -1 for n in sympy.preorder_traversal(node.exp)):
            return False
        if not node.exp.free_symbols and abs(complex(sympy.N(node.exp))) > 1000:
            return False
    return True


def _split_top_level(s: str):
    """'(1, 2)' -> ['1', '2'] for tuples/lists; None if not a tuple."""
    s = s.strip()
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        inner = s[1:-1]
    elif "," in s:
        inner = s
    else:
        return None
    parts, depth, cur = [], 0, ""
    for ch in inner:
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts if len(parts) > 1 else None


def _equal_expr(a, b) -> bool:
    try:
        if not a.free_symbols and not b.free_symbols:
            va, vb = complex(sympy.N(a, 30)), complex(sympy.N(b, 30))
            return abs(va - vb) <= 1e-6 * max(1.0, abs(vb))
        return sympy.simplify(a - b) == 0
    except Exception:
        return False


def _string_key(s: str) -> str:
    return re.sub(r"\s+", "", s).lower().strip("()")


def equivalent(pred: str, gold: str) -> bool:
    p, g = normalize(pred), normalize(gold)
    tp, tg = _split_top_level(p), _split_top_level(g)
    if tp is not None or tg is not None:
        if tp is None or tg is None or len(tp) != len(tg):
            return False
        return all(equivalent(x, y) for x, y in zip(tp, tg))
    ep, eg = _safe_parse(p), _safe_parse(g)
    if ep is not None and eg is not None and _equal_expr(ep, eg):
        return True
    return _string_key(p) == _string_key(g) and bool(_string_key(g))


def verify(response: str, answer: str) -> float:
    """1.0 if the final answer after the thinking part equals `answer`, else 0.0."""
    text = strip_thinking(response)
    if text is None:
        return 0.0
    pred = extract_answer(text)
    if pred is None:
        return 0.0
    return float(equivalent(pred, str(answer)))
