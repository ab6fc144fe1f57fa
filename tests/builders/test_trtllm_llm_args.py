"""The keys TensorRT-LLM's LLM arguments accept (data/upstream/trtllm-llm-args-00043967.json, written by
scripts/trtllm_llm_args.py from tensorrt_llm/llmapi/llm_args.py at NVIDIA/TensorRT-LLM
0004396720054fd8e205cbf616f21f0b57c6b412), and every key `dflash-trt plan` writes into trtllm-serve.yaml against
them: the top level is TorchLlmArgs (extra keys forbidden, BaseLlmArgs' model_config), speculative_config a
DFlashDecodingConfig. What the validators' bodies enforce on draft_len_schedule and max_concurrency is checked by
check_like_decoding_base_config (the rules as test_trtllm_serve_config.py states them from the same source).

The record names the sha256 and length of the copy of llm_args.py it was extracted from; where that copy is at hand
(COPY, an ignored path: the repository's file, not this project's), the record is checked to be the script's output
on it."""

import hashlib
import json
import subprocess
import sys

import pytest
from builders.test_trtllm_serve_config import check_like_decoding_base_config

from dflash_trt.builders.trtllm_llm_args import COMMIT, RECORD, accepts, fields_of, yaml_problems
from dflash_trt.settings import REPO_ROOT

yaml = pytest.importorskip("yaml")
pytest.importorskip("matplotlib")

DATA = RECORD
SCRIPT = REPO_ROOT / "scripts" / "trtllm_llm_args.py"
COPY = REPO_ROOT / ".cache" / "upstream" / f"llm_args-{COMMIT}.py"
UPSTREAM_CHARS = 314102  # read_file's total_chars for the file at COMMIT


@pytest.fixture(scope="module")
def record():
    return json.loads(DATA.read_text())


def check_yaml(record, loaded):
    """Every key of a trtllm-serve.yaml is a field with an accepted value; speculative_config's likewise."""
    top, spec_fields = fields_of(record, "TorchLlmArgs"), fields_of(record, "DFlashDecodingConfig")
    assert record["classes"]["BaseLlmArgs"]["extra_forbidden"]  # an unknown top-level key is refused
    for key, value in loaded.items():
        assert key in top, f"{key}: not a TorchLlmArgs field at {COMMIT[:8]}"
        if key != "speculative_config":
            assert accepts(top[key]["rule"], value), (key, value, top[key]["rule"])
    spec = loaded.get("speculative_config")
    if spec is not None:
        for key, value in spec.items():
            assert key in spec_fields, f"speculative_config.{key}: not a DFlashDecodingConfig field"
            assert accepts(spec_fields[key]["rule"], value), (key, value, spec_fields[key]["rule"])
        check_like_decoding_base_config(spec)
    assert yaml_problems(loaded, record) == []  # the package's check (plan overlay, the stand-in) agrees


def test_the_record_names_its_source_and_the_classes_the_yaml_is_read_as(record):
    source = record["source"]
    assert {k: source[k] for k in ("repository", "path", "commit")} == {
        "repository": "NVIDIA/TensorRT-LLM",
        "path": "tensorrt_llm/llmapi/llm_args.py",
        "commit": COMMIT,
    }
    # the whole file, not a part of it: its length is the upstream file's, its digest a sha256
    assert source["chars"] == UPSTREAM_CHARS and source["bytes"] >= source["chars"]
    assert len(source["sha256"]) == 64 and int(source["sha256"], 16) >= 0
    # the tail of the file (validators after character 280000) is in the record
    torch_validators = {v["name"] for v in record["classes"]["TorchLlmArgs"]["validators"]}
    assert {"validate_speculative_config", "validate_speculative_beam_history_d2h"} <= torch_validators
    # sampler_type is no field but still taken on input (dropped after a check); StrictBaseModel is imported
    assert record["classes"]["TorchLlmArgs"]["removed_args"] == {"sampler_type": "_check_removed_sampler_type"}
    assert record["bases_not_in_file"] == ["StrictBaseModel"]
    assert record["yaml"] == {"top_level": "TorchLlmArgs", "speculative_config": "DFlashDecodingConfig"}
    assert record["classes"]["TorchLlmArgs"]["bases"] == ["BaseLlmArgs"]
    assert record["classes"]["DFlashDecodingConfig"]["bases"] == ["DecodingBaseConfig"]
    names = {v["name"] for v in record["classes"]["DecodingBaseConfig"]["validators"]}
    assert {
        "validate_draft_len_schedule_and_sort",
        "validate_max_concurrency_and_draft_len_schedule_mutually_exclusive",
    } <= names


def test_the_record_is_the_scripts_output_on_the_named_copy(record, tmp_path):
    """Where the copy of llm_args.py is at hand, it is the one the record names and the record is what the script
    makes of it (so an edit to either, or a different copy, fails here)."""
    if not COPY.exists():
        pytest.skip(f"{COPY} absent: the copy is not committed (see data/upstream's note for how it was read)")
    data = COPY.read_bytes()
    assert hashlib.sha256(data).hexdigest() == record["source"]["sha256"]
    assert len(data.decode("utf-8")) == record["source"]["chars"] == UPSTREAM_CHARS
    out = tmp_path / "again.json"
    args = [sys.executable, str(SCRIPT), str(COPY), "--commit", COMMIT, "--total-chars", str(UPSTREAM_CHARS)]
    subprocess.run([*args, "--out", str(out), "--note", record["note"]], check=True, capture_output=True, text=True)
    assert json.loads(out.read_text()) == record


@pytest.mark.parametrize(
    "best",
    [
        {1: 8, 8: 5, 64: 3},  # draft_len_schedule
        {1: 8, 8: 8, 64: 1},  # the target alone best at 64: the schedule floors it at 1 draft
        {1: 8, 8: 8},  # max_draft_len alone
    ],
)
@pytest.mark.parametrize("with_drafter", [True, False])
def test_every_key_the_plan_writes_is_accepted(record, tmp_path, best, with_drafter):
    from plan.test_plan import _plan, _written

    from dflash_trt.settings import DEMO_DRAFTER

    _, files = _written(tmp_path, _plan(best), DEMO_DRAFTER if with_drafter else None)
    loaded = yaml.safe_load(files["trtllm-serve.yaml"])
    assert "speculative_config" in loaded and "max_batch_size" in loaded
    check_yaml(record, loaded)


def test_the_target_alone_yaml_and_trtllm_serve_configs_attention_backend_are_accepted(record, tmp_path):
    import dataclasses

    from plan.test_plan import _plan, _written

    from dflash_trt.builders.trtllm_serve import ATTENTION_BACKENDS, serve_config, speculation_limits
    from dflash_trt.settings import DEMO_DRAFTER

    _, files = _written(tmp_path, dataclasses.replace(_plan({1: 8, 8: 5}), limits=None))
    alone = yaml.safe_load(files["trtllm-serve.yaml"])
    assert "speculative_config" not in alone
    check_yaml(record, alone)
    for backend in ATTENTION_BACKENDS:
        check_yaml(record, serve_config(DEMO_DRAFTER, attention_backend=backend))
    # trtllm-serve-config's max_concurrency (drafting up to a batch size, then off: speculation_limits)
    limited = {**serve_config(DEMO_DRAFTER)["speculative_config"], **speculation_limits({1: 7, 8: 7, 64: 0})}
    assert limited["max_concurrency"] == 8
    check_yaml(record, {"speculative_config": limited})


def test_a_value_outside_the_recorded_rules_is_refused(record):
    """The check can fail: the values TensorRT-LLM would refuse are refused here too."""
    top, spec = fields_of(record, "TorchLlmArgs"), fields_of(record, "DFlashDecodingConfig")
    assert not accepts(spec["max_draft_len"]["rule"], -1)  # Optional[NonNegativeInt]
    assert not accepts(spec["max_concurrency"]["rule"], 0)  # Optional[PositiveInt]
    assert not accepts(spec["decoding_type"]["rule"], "Eagle3")  # Literal["DFlash"]
    assert not accepts(spec["attention_backend"]["rule"], "FA4")  # not at this commit (1.3.0rc27 docs add it)
    assert not accepts(top["enable_iter_perf_stats"]["rule"], "yes")
    assert not accepts(top["max_stats_len"]["rule"], -2)  # ge=-1
    with pytest.raises(AssertionError, match="not a TorchLlmArgs field"):
        check_yaml(record, {"max_num_seqs": 64})


def test_the_script_extracts_fields_rules_and_bases_from_a_source(tmp_path):
    """The script on a small source in llm_args.py's declaration style (written here, not TensorRT-LLM's): Optional
    and constrained ints, Field bounds and aliases, a Literal, a StrEnum, a base class's fields, validators."""
    source = tmp_path / "llm_args.py"
    source.write_text(
        "class Mode(StrEnum):\n    A = 'a'\n    B = 'b'\n\n\n"
        "class DecodingBaseConfig(StrictBaseModel):\n"
        "    max_draft_len: Optional[NonNegativeInt] = Field(default=None)\n"
        "    model: Optional[Union[str, Path]] = Field(default=None, validation_alias=AliasChoices('m', 'md'))\n"
        "    rate: Optional[float] = Field(default=None, ge=0.0, le=1.0)\n"
        "    mode: Mode = Field(default=Mode.A)\n"
        "    _private: bool = PrivateAttr(True)\n\n"
        "    @field_validator('max_draft_len')\n    @classmethod\n    def check(cls, v): ...\n\n\n"
        "class DFlashDecodingConfig(DecodingBaseConfig):\n"
        "    decoding_type: Literal['DFlash'] = Field(default='DFlash')\n"
        "    ids: list[int] | None = None\n\n\n"
        "class BaseLlmArgs(StrictBaseModel):\n"
        "    model_config = ConfigDict(extra='forbid')\n"
        "    max_batch_size: Optional[int] = Field(default=2048)\n"
        "    session: Optional[object] = Field(default=None, alias='_session')\n\n\n"
        "_TORCH_LLMARGS_REMOVED_ARG_CHECKS: Dict[str, Callable[[Any], None]] = {'old_key': _check_old_key}\n\n\n"
        "class TorchLlmArgs(BaseLlmArgs):\n"
        "    schedule: Optional[dict[int, int]] = Field(default=None)\n"
    )
    out = tmp_path / "out.json"
    args = [sys.executable, str(SCRIPT), str(source), "--commit", "a" * 40, "--out", str(out)]
    subprocess.run(args, check=True, capture_output=True, text=True)
    got = json.loads(out.read_text())
    base = got["classes"]["DecodingBaseConfig"]["fields"]
    assert base["max_draft_len"]["rule"] == {"type": "int", "ge": 0, "optional": True}
    assert base["model"]["validation_alias"] == ["m", "md"] and base["model"]["rule"]["type"] == "union"
    assert base["rate"]["rule"] == {"type": "float", "optional": True, "ge": 0.0, "le": 1.0}
    assert base["mode"]["rule"]["values"] == ["a", "b"] and "_private" not in base
    assert got["classes"]["DecodingBaseConfig"]["validators"][0]["fields"] == ["max_draft_len"]
    dflash = got["classes"]["DFlashDecodingConfig"]["fields"]
    assert dflash["decoding_type"]["rule"] == {"type": "literal", "values": ["DFlash"]}
    assert dflash["ids"]["rule"] == {"type": "list", "items": {"type": "int"}, "optional": True}
    assert got["classes"]["BaseLlmArgs"]["extra_forbidden"] is True
    assert got["classes"]["BaseLlmArgs"]["fields"]["session"]["alias"] == "_session"
    assert got["classes"]["TorchLlmArgs"]["fields"]["schedule"]["rule"]["type"] == "dict"
    assert got["classes"]["TorchLlmArgs"]["removed_args"] == {"old_key": "_check_old_key"}
    assert got["bases_not_in_file"] == ["StrictBaseModel"]
    text = source.read_text()
    assert got["source"]["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert got["source"]["chars"] == len(text)
    bad = subprocess.run([*args[:3], "--commit", "xyz"], capture_output=True, text=True)
    assert bad.returncode == 2 and "40 lower-case hex digits" in bad.stderr
    # a copy shorter than the upstream file is refused, and nothing is written
    short = subprocess.run([*args, "--total-chars", str(len(text) + 1)], capture_output=True, text=True)
    assert short.returncode == 2 and "not the whole file" in short.stderr
    assert json.loads(out.read_text()) == got
    whole = subprocess.run([*args, "--total-chars", str(len(text))], capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr


def test_yaml_problems_names_each_refused_key_and_value(record):
    """The package's check (what `plan overlay` and the stand-in trtllm-serve refuse) on a YAML with one fault of
    each kind: an unknown top-level key, a bad top-level value, an unknown speculative_config key, a literal
    outside its values, and a schedule whose smallest key does not map to max_draft_len."""
    bad = {
        "max_num_seqs": 8,
        "enable_iter_perf_stats": "yes",
        "speculative_config": {
            "decoding_type": "DFlash",
            "max_draft_len": 7,
            "num_speculative_tokens": 7,
            "attention_backend": "FA4",
            "draft_len_schedule": {1: 5, 8: 3},
        },
    }
    got = yaml_problems(bad, record)
    for part in ("max_num_seqs", "enable_iter_perf_stats", "num_speculative_tokens", "attention_backend", "smallest"):
        assert sum(part in p for p in got) == 1, (part, got)
    assert len(got) == 5 and all(COMMIT[:8] in p for p in got[:4])
    assert yaml_problems([1, 2], record) == ["the YAML is not a mapping of LLM arguments"]
