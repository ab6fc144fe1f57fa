"""Prompt sets for evaluation. The code set is cut from HELD-OUT standard-library files (never
trained on by the demo models); the others are generic."""

from __future__ import annotations

from ..train.data import read_texts, stdlib_files


def held_out_code_prompts(n: int = 20, prefix_chars: int = 400) -> list[str]:
    """The first `prefix_chars` characters (cut at a line end) of n held-out stdlib files,
    spread evenly over the sorted held-out list."""
    texts = [t for t in read_texts(stdlib_files("held-out"), min_chars=4 * prefix_chars)]
    if len(texts) < n:
        raise ValueError(f"only {len(texts)} held-out files are long enough; asked for {n}")
    step = len(texts) / n
    prompts = []
    for i in range(n):
        text = texts[int(i * step)]
        cut = text.rfind("\n", 0, prefix_chars)
        prompts.append(text[: cut + 1 if cut > 0 else prefix_chars])
    return prompts


def repetitive_prompts(n: int = 5) -> list[str]:
    """Text whose continuation is largely a copy: where drafting shines (and prompt lookup too)."""
    base = [
        "ERROR_CODES = {\n    'E001': 'not found',\n    'E002': 'denied',\n    'E003': 'timeout',\n",
        "def test_add_1():\n    assert add(1, 1) == 2\n\ndef test_add_2():\n    assert add(2, 2) == 4\n\n",
        "import os\nimport sys\nimport re\nimport json\nimport time\nimport math\n",
        "class A:\n    pass\n\nclass B:\n    pass\n\nclass C:\n    pass\n\n",
        "x0 = 0\nx1 = 1\nx2 = 2\nx3 = 3\nx4 = 4\n",
        "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\n",
    ]
    return (base * (n // len(base) + 1))[:n]


def free_text_prompts(n: int = 5) -> list[str]:
    """Prose-like prompts (comments and docstrings): harder for a code model to continue predictably."""
    base = [
        '"""This module provides a simple interface for reading configuration files.\n\n',
        "# The scheduler keeps a queue of pending jobs and runs them in order of priority.\n",
        '"""Utilities for working with dates and times.\n\nThe functions here ',
        "# Note: this is a workaround for a bug in older versions of the library, where\n",
        '"""Return the number of items in the collection.\n\n    ',
        "# TODO: handle the case where the file does not exist\n",
    ]
    return (base * (n // len(base) + 1))[:n]


PROMPT_SETS = {"code": held_out_code_prompts, "repetitive": repetitive_prompts, "free": free_text_prompts}
