"""The proposer workloads (bench/workloads.py) and the side-by-side harness's tables (bench/proposers.py)."""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import pytest

from dflash_trt.bench import workloads as wl
from dflash_trt.bench.prompts import PROMPT_SETS
from dflash_trt.bench.proposers import checks, summarise, tables


@pytest.fixture(scope="module")
def sets() -> dict[str, wl.Workload]:
    return {name: build(4) for name, build in wl.WORKLOADS.items() if name != "random"}  # random: no source text


def test_every_set_comes_from_installed_packages_never_the_standard_library(sets):
    """The demo models were trained on the standard library (train.corpus.stdlib_files); site-packages is outside
    it, and every set names its sources with their versions."""
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    for w in sets.values():
        assert len(w.prompts) == len(w.labels) == 4 and w.sources
        assert all(v != "unknown" for v in w.sources.values())
        for folder in w.sources:
            assert (wl.site_packages() / folder).is_dir()
            assert not (stdlib / folder).exists()  # a standard-library module of that name would be trained on


def test_the_sets_are_deterministic_and_spread_over_packages(sets):
    again = wl.body_prompts(4)
    assert again.prompts == sets["bodies"].prompts and again.labels == sets["bodies"].labels
    assert len({label.split("/")[0] for label in sets["bodies"].labels}) >= 3
    assert len({label.split("/")[0] for label in sets["rewrite"].labels}) == 4  # the pairs in turn


def test_a_body_prompt_is_a_head_that_ends_at_its_docstring(sets):
    for p in sets["bodies"].prompts:
        assert p.startswith(("def ", "async def ", "@")) and p.endswith(('"', "'"))
        ast.parse(p + "\n    pass\n")  # a whole function once a body follows


def test_in_file_prompts_carry_the_rest_of_the_file_but_not_the_function(sets):
    for p, label in zip(sets["in-file"].prompts, sets["in-file"].labels):
        folder, rest = label.split("/", 1)
        rel, line = rest.rsplit(":", 1)
        source = (wl.site_packages() / folder / rel).read_text()
        fn = next(
            f
            for f in wl.functions(wl.site_packages() / folder / rel, wl.site_packages() / folder, True)
            if f.line == int(line)
        )
        context, head = p.rsplit("\n\n\n", 1)
        assert head == fn.head and fn.body.strip() not in context  # the function's own body is not given away
        without = source[: fn.start] + source[fn.end :]
        assert len(context) > 1000 and all(line in without for line in context.splitlines())
        assert context.count("def ") >= 2  # other functions of the file


def test_a_rewrite_prompt_gives_the_earlier_version_whole_then_the_later_head(sets):
    for p in sets["rewrite"].prompts:
        first, second = p.split("\n\n\n# ")
        old_label, new_label = first.splitlines()[0], second.splitlines()[0]
        assert old_label.split(":")[1] == new_label.split(":")[1]  # the same file
        assert old_label.split()[1] != new_label.split()[1]  # two packages' names or versions
        old_fn = "\n".join(first.splitlines()[1:])
        ast.parse(old_fn)  # the earlier version, whole
        head = "\n".join(second.splitlines()[1:])
        name = head.split("def ", 1)[1].split("(")[0]
        assert f"def {name}(" in old_fn


def test_long_prompts_ask_for_512_tokens_and_sessions_grow_by_heads(sets):
    assert sets["long"].max_new_tokens == wl.LONG_TOKENS == 512
    assert all(w.max_new_tokens == wl.SHORT_TOKENS for n, w in sets.items() if n != "long")
    opening, heads, source = wl.session_turns(3)
    assert len(heads) == 3 and all(h.startswith(("def ", "async def ", "@")) for h in heads)
    assert source.endswith(".py") and opening


def test_the_benchmark_and_the_evaluation_offer_the_sets():
    for name in ("bodies", "in-file", "rewrite"):
        assert PROMPT_SETS[name](2) == wl.WORKLOADS[name](2).prompts


def test_too_few_prompts_is_said():
    with pytest.raises(ValueError, match="only 1 usable things"):
        wl.spread([1], 2, "things")


def _record(workload: str, method: str, prompt: int, tokens: int, seconds: float, tau: float) -> dict:
    return {
        "workload": workload,
        "method": method,
        "prompt": prompt,
        "new_tokens": tokens,
        "seconds": seconds,
        "tau": tau,
    }


def test_the_tables_give_tokens_per_second_over_prompts_and_the_issue_bars():
    records = []
    for i in range(2):
        records += [
            _record("rewrite", "target", i, 100, 2.0, 1.0),
            _record("rewrite", "dflash", i, 100, 1.0, 2.0 + i),
            _record("rewrite", "hybrid", i, 100, 0.5, 4.0),
            _record("rewrite", "prompt-lookup", i, 100, 0.8, 3.0),
        ]
    s = summarise(records)
    assert s["rewrite"]["target"]["tokens_per_s"] == 50.0 and s["rewrite"]["hybrid"]["tokens_per_s"] == 200.0
    assert s["rewrite"]["dflash"]["tau"] == 2.5 and s["rewrite"]["hybrid"]["vs_dflash"] == 2.0
    assert s["rewrite"]["dflash"]["vs_target"] == 2.0
    found = {c["check"]: c for c in checks(s)}
    assert set(found) == {"rewrite: hybrid >= 1.3x dflash", "rewrite: hybrid >= 1.0x prompt-lookup"}
    assert found["rewrite: hybrid >= 1.3x dflash"]["ok"] and found["rewrite: hybrid >= 1.3x dflash"]["ratio"] == 2.0
    slow = summarise([dict(r, seconds=4.0) if r["method"] == "hybrid" else r for r in records])
    assert not {c["check"]: c for c in checks(slow)}["rewrite: hybrid >= 1.0x prompt-lookup"]["ok"]
    text = tables(s, checks(s))
    assert "| rewrite | hybrid | 200.0 | 4.00x | 2.00x | 4.00 |" in text and "| yes |" in text


def test_the_chat_workloads_repeat_their_prompt_and_prose_does_not():
    """`chat-rewrite` and `revise` carry the whole function the answer restates, `extract` the passage whose
    sentences it quotes, `prose` nothing to copy; every conversation ends with the user's turn."""
    built = {name: build(3) for name, build in wl.CHAT_WORKLOADS.items()}
    for w in built.values():
        assert len(w.messages) == len(w.prompts) == len(w.labels) == 3
        assert all(m[-1]["role"] == "user" and m[-1]["content"] == p for m, p in zip(w.messages, w.prompts))
    for m in built["chat-rewrite"].messages:
        name = m[0]["content"].split("`")[1]
        assert f"`{name}_value`" in m[0]["content"] and f"{name}" in m[0]["content"].split("```python")[1]
    for m in built["revise"].messages:
        assert m[1]["role"] == "assistant" and m[1]["content"].startswith("```python\n") and "def " in m[1]["content"]
    for m in built["extract"].messages:
        passage, word = m[0]["content"].split("\n\n", 1)[1].rsplit("\n\n", 1)
        assert word.split('"')[1] in passage.lower()
    assert all("```" not in p for p in built["prose"].prompts)


def test_random_prompts_are_fixed_and_do_not_repeat():
    a, b = wl.random_prompts(3), wl.random_prompts(3)
    assert a.prompts == b.prompts and len(set(a.prompts)) == 3
    assert all(len(p) == 300 and not any(p[i : i + 12] in p[i + 1 :] for i in range(0, 288, 12)) for p in a.prompts)
