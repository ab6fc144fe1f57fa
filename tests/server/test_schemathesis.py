"""Schemathesis (property-based testing from /openapi.json), run as its users run it (`st run`), against
`dflash-trt serve` as a real process on a real port: every operation, a fixed seed, a bounded number of
examples each. All of its checks: no 5xx, status codes, content types, headers and bodies as documented,
invalid requests rejected; "valid requests accepted" is ours (schemathesis_hooks.py), which knows the
two answers the schema cannot state (a prompt + max_tokens that overflow the context; an unknown model id
in a path).

The models are tiny and their context short (64 tokens), so that any valid request is cheap.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CHAT_TEMPLATE, make_tokenizer
from server_harness import HANG_S
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.server.process import start_serve

CONTEXT = 64
EXAMPLES = 15  # per operation: with the coverage phase about 400 requests, a minute on two busy cores
SEED = 20261130


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("schemathesis")
    tok = make_tokenizer(root / "target", chat_template=CHAT_TEMPLATE)  # chat is served (a model without one: 400)
    target = make_tiny_target(root / "target", vocab_size=len(tok), layers=4, seed=1, max_position_embeddings=CONTEXT)
    make_tiny_drafter(target.config, root / "drafter", layers=1, block_size=4, mask_token_id=tok.mask_token_id)
    proc, url = start_serve(
        [
            "--target",
            str(root / "target"),
            "--drafter",
            str(root / "drafter"),
            "--threads",
            "1",
            "--model-name",
            "tiny",
            "--default-max-tokens",
            "8",
        ],
        root / "serve.log",
        env={"DFLASH_TRT_API_KEY": ""},
        timeout_s=HANG_S,
    )
    try:
        yield url, root / "serve.log"
    finally:
        proc.terminate()
        proc.wait(60)


def test_api_keeps_its_openapi_contract(served, tmp_path):
    url, log = served
    st = Path(sys.executable).parent / "st"
    tests = str(Path(__file__).resolve().parents[1])  # tests/: where schemathesis_hooks.py lives
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [
            str(st),
            "run",
            url + "/openapi.json",
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance",
            "--seed",
            str(SEED),
            "--generation-deterministic",
            "--max-examples",
            str(EXAMPLES),
            "--phases",
            "examples,coverage,fuzzing",
            "--request-timeout",
            "60",
            "--no-color",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=tmp_path,
    )  # its cache goes to tmp_path
    report = run.stdout + run.stderr
    assert run.returncode == 0, report[-6000:]
    assert "valid_requests_accepted" in report or "passed" in report.lower()
    assert "Traceback" not in log.read_text()
