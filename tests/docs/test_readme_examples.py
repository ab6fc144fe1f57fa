"""The README's first examples, run as written against the demo models: a real server on a free port for
curl and the OpenAI client, the CLI, the Python API. Each prints a completion whose body is code (it parses
with two or more real statements: dflash_trt.bench.quality), and the output the README shows is the real one."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import running_server

from dflash_trt.bench.quality import check_body
from dflash_trt.loading import load_decoder
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def use_it_blocks() -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks of the README's "Use it" section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it\n") : text.index("\n## ", text.index("## Use it\n") + 1)]
    return re.findall(r"^```(\w*)\n(.*?)^```", section, re.S | re.M)


def head_in(code: str) -> str:
    """The function head a block sends, as the model receives it (JSON or Python escapes undone)."""
    m = re.search(r'def \w+\([^)]*\):\\n {4}(?:\\"|")(?:\\"|")(?:\\"|").*?(?:\\"|")(?:\\"|")(?:\\"|")', code)
    assert m, code
    return m.group(0).replace('\\"', '"').replace("\\n", "\n")


def run(code: str, *argv: str) -> str:
    done = subprocess.run([*argv, code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def server():
    decoder = load_decoder(DEMO_TARGET, DEMO_DRAFTER)  # as `dflash-trt serve`: the default drafter dtype
    with running_server(decoder) as (url, _):  # the server's default settings: adaptive block sizes
        yield url.removeprefix("http://")


def here(code: str, server: str) -> str:
    return code.replace("localhost:8000", server).replace("127.0.0.1:8000", server).replace(".venv/bin/", f"{BIN}/")


def test_curl_and_cli_print_the_code_the_readme_shows(server):
    (lang, shell), (shown_lang, shown) = use_it_blocks()[:2]
    assert lang == "bash" and shown_lang == "python"
    head = head_in(shell)
    out = run("set -eo pipefail\n" + here(shell, server), "bash", "-c")  # a failing curl fails the test
    completion = out[: (len(out) - 2) // 2]  # each command prints the completion and a newline
    assert out == f"{completion}\n{completion}\n", out  # curl and the CLI print the same completion
    assert check_body(head, completion).is_code, completion
    assert shown.rstrip("\n") == (head + completion).rstrip(), "the README's shown output is not the real one"


@pytest.mark.parametrize("which", ["openai", "python"])
def test_python_examples_print_code(server, which):
    blocks = [code for lang, code in use_it_blocks() if lang == "python"]
    code = next(c for c in blocks if ("OpenAI(" if which == "openai" else "load_decoder(") in c)
    out = run(here(code, server), sys.executable, "-c")
    head = head_in(code)
    completion = out if which == "openai" else out.rsplit("\n", 2)[0]  # the API example also prints tau
    assert check_body(head, completion).is_code, out


def test_a_trailing_newline_gets_the_same_body(server):
    """The README's prompt with the newline an editor adds: healed (decoding/healing.py), every text path
    prints the same body, less the newline the prompt now holds; without healing the model ends the function."""
    import httpx

    (_, shell), _ = use_it_blocks()[:2]
    head = head_in(shell)
    stop, url = ["\ndef "], f"http://{server}"

    def texts(prompt: str, **extra: object) -> tuple[str, str]:
        native = httpx.post(f"{url}/generate", json={"prompt": prompt, "max_tokens": 64, "stop": stop, **extra})
        openai = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 64, "stop": stop, "temperature": 0, **extra},
        )
        assert native.status_code == openai.status_code == 200, (native.text, openai.text)
        return native.json()["text"], openai.json()["choices"][0]["text"]

    plain = texts(head)
    assert plain[0] == plain[1] and plain[0].startswith("\n")
    healed = texts(head + "\n")
    assert healed == (plain[0][1:], plain[1][1:])
    assert check_body(head + "\n", healed[0]).is_code
    cli = [f"{BIN}/dflash-trt", "generate", "--max-new-tokens", "64", "--stop", "\ndef "]
    out = subprocess.run([*cli, "--prompt", head + "\n"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.rstrip("\n") == healed[0].rstrip("\n"), out.stderr[-2000:]
    unhealed = texts(head + "\n", heal_prompt=False)[0]
    assert unhealed != healed[0]  # the boundary the tokenizer never saw: the model does not write this body
