"""Every path the images' configuration points at is copied into that image (read from the Dockerfile's stages).

Nothing here builds an image (no Docker engine in this workplace): the Dockerfile is parsed as text, stage by
stage (FROM ... AS name; WORKDIR; COPY src... dest; ENV), and the paths engines.toml, DFLASH_TRT_MODELS and the
gpu-smoke script need are checked against what each stage's COPY lines put there."""

import re
from pathlib import Path, PurePosixPath

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]

DOCKERFILE = ROOT / "Dockerfile"


def stages(text: str) -> dict[str, dict]:
    """name -> {"copies": [(src, absolute dest)], "env": {...}, "workdir": str}; line continuations joined."""
    out: dict[str, dict] = {}
    current = None
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.I)
            current = {"copies": [], "env": {}, "workdir": "/"}
            out[m.group(1) if m else f"stage{len(out)}"] = current
        elif current is None:
            continue
        elif word == "WORKDIR":
            current["workdir"] = str(PurePosixPath(current["workdir"]) / rest.strip())
        elif word == "COPY":
            parts = [p for p in rest.split() if not p.startswith("--")]
            *srcs, dest = parts
            base = PurePosixPath(current["workdir"]) / dest
            for src in srcs:
                target = base / PurePosixPath(src).name if dest.endswith("/") else base
                current["copies"].append((src.rstrip("/"), str(target)))
        elif word == "ENV":
            for k, v in re.findall(r"(\w+)=(\S+)", rest):
                current["env"][k] = v
    return out


def copied(stage: dict, path: str) -> bool:
    """Is absolute `path` inside something a COPY of this stage wrote?"""
    p = PurePosixPath(path)
    return any(p == PurePosixPath(dest) or PurePosixPath(dest) in p.parents for _, dest in stage["copies"])


def needed_paths(stage: dict) -> list[str]:
    workdir = PurePosixPath(stage["workdir"])
    cfg = tomllib.loads((ROOT / "engines.toml").read_text())
    paths = [str(workdir / cfg[k]) for k in ("target", "drafter")]
    models = stage["env"].get("DFLASH_TRT_MODELS")
    if models:
        paths += [models + "/target", models + "/drafter"]
    return paths


def test_parser_reads_this_dockerfile():
    parsed = stages(DOCKERFILE.read_text())
    assert {"cpu", "gpu"} <= set(parsed)
    assert ("dflash_trt", "/app/dflash_trt") in parsed["gpu"]["copies"]
    assert parsed["gpu"]["env"]["DFLASH_TRT_MODELS"] == "/app/models"


def test_parser_catches_a_stage_without_models():
    """Negative control: the gpu stage as it was before models/ was copied fails the check."""
    text = DOCKERFILE.read_text().replace("COPY models ./models\n", "")
    gpu = stages(text)["gpu"]
    assert [p for p in needed_paths(gpu) if not copied(gpu, p)] == [
        "/app/models/target",
        "/app/models/drafter",
        "/app/models/target",
        "/app/models/drafter",
    ]


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_every_configured_model_path_is_copied(name):
    stage = stages(DOCKERFILE.read_text())[name]
    missing = [p for p in needed_paths(stage) if not copied(stage, p)]
    assert not missing, f"{name} stage does not ship {missing}"
    for src, _ in stage["copies"]:
        assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"


def test_gpu_stage_ships_what_gpu_smoke_imports():
    gpu = stages(DOCKERFILE.read_text())["gpu"]
    assert copied(gpu, "/app/scripts/gpu_smoke.py")
    assert copied(gpu, "/app/tests/tiny_models.py")  # the tiny random pair for tp > 1


def runtime_user(text: str) -> dict[str, str | None]:
    """stage name -> the user its last USER line sets (None: no USER, the base image's, root for these bases)."""
    out: dict[str, str | None] = {}
    current = None
    for line in text.replace("\\\n", " ").splitlines():
        word, _, rest = line.strip().partition(" ")
        if word.upper() == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.I)
            current = m.group(1) if m else f"stage{len(out)}"
            out[current] = None
        elif word.upper() == "USER" and current is not None:
            out[current] = rest.strip()
    return out


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_every_stage_runs_as_the_non_root_user_the_manifests_name(name):
    """The image's user is the uid the single-node and Triton pods run as (runAsUser, runAsNonRoot: the kubelet
    refuses a root image there), created in that stage with that uid, and it owns /app (engines and results)."""
    text = DOCKERFILE.read_text()
    user = runtime_user(text)[name]
    assert user is not None and user.isdigit() and int(user) != 0, user
    for overlay in ("single-node", "triton"):
        manifest = (ROOT / "deploy" / "k8s" / overlay / "deployment.yaml").read_text()
        assert f"runAsUser: {user}" in manifest and "runAsNonRoot: true" in manifest, overlay
    stage = text.split(f"AS {name}", 1)[1].split("\nFROM ", 1)[0]
    assert re.search(rf"useradd --uid {user} ", stage) and re.search(rf"(chown|install -d) .*{user}:?.*\s/app", stage)


def test_runtime_user_parser_sees_a_stage_without_user():
    """Negative control: the Dockerfile without its USER lines leaves both stages to the base image's root."""
    text = "\n".join(line for line in DOCKERFILE.read_text().splitlines() if not line.startswith("USER "))
    assert runtime_user(text) == {"cpu": None, "gpu": None}
