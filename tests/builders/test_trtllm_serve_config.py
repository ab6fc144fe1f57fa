"""`dflash-trt trtllm-serve-config`: the YAML for TensorRT-LLM's native DFlash, checked against the sources.

No TensorRT-LLM here: the field list below and the validator rules are transcribed from
NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py at commit 0004396720054fd8e205cbf616f21f0b57c6b412 (main, a
post-1.2 development snapshot; 1.2 itself has no DFlashDecodingConfig), class DFlashDecodingConfig and its base
DecodingBaseConfig; the drafter-folder expectations from tensorrt_llm/_torch/models/modeling_dflash.py
(DFlashForCausalLM.__init__ / load_weights) of the same snapshot."""

import json
import shutil
import subprocess
import sys

import pytest
from tiny_models import make_tiny_drafter, make_tiny_target

from dflash_trt.builders.trtllm_serve import (
    ServeConfigError,
    drafter_problems,
    schedule_from_costs,
    serve_config,
    speculation_limits,
    target_problems,
    to_yaml,
)
from dflash_trt.costgrid import TRTLLM_ENGINE, grid_identity, read_target_config
from dflash_trt.decoding.cost import EngineCost
from dflash_trt.settings import DEMO_DIR, DEMO_DRAFTER, DEMO_TARGET

yaml = pytest.importorskip("yaml")

# DecodingBaseConfig's fields, then DFlashDecodingConfig's own (llm_args.py, commit above).
DECODING_BASE_FIELDS = {
    "max_draft_len",
    "max_total_draft_tokens",
    "speculative_model",  # alias: speculative_model_dir
    "max_concurrency",
    "draft_len_schedule",
    "load_format",
    "acceptance_rate_window_size",
    "acceptance_rate_threshold",
    "use_rejection_sampling",
    "allow_advanced_sampling",
    "advanced_sampling_mode",
    "enable_penalty",
}
DFLASH_DECODING_CONFIG_FIELDS = DECODING_BASE_FIELDS | {
    "mask_token_id",
    "target_layer_ids",
    "decoding_type",  # Literal["DFlash"]
    "attention_backend",  # Literal["VANILLA", "TRTLLM"]
}
LLM_ARGS_KEYS_WE_WRITE = {"speculative_config"}  # BaseLlmArgs.speculative_config


def check_like_decoding_base_config(spec: dict) -> None:
    """DecodingBaseConfig's validators (same file): schedule keys >= 1, lengths >= 0 and <= max_draft_len, the
    smallest key's length == max_draft_len; max_concurrency and draft_len_schedule mutually exclusive."""
    assert spec["decoding_type"] == "DFlash"
    assert isinstance(spec["max_draft_len"], int) and spec["max_draft_len"] >= 0
    schedule = spec.get("draft_len_schedule")
    if schedule is not None:
        assert "max_concurrency" not in spec
        assert all(b >= 1 and 0 <= k <= spec["max_draft_len"] for b, k in schedule.items())
        assert schedule[min(schedule)] == spec["max_draft_len"]
    if "max_concurrency" in spec:
        assert spec["max_concurrency"] >= 1


def test_demo_pair_yaml_keys_are_all_dflash_decoding_config_fields(tmp_path):
    out = tmp_path / "dflash.yaml"
    run = subprocess.run(
        [sys.executable, "-m", "dflash_trt.cli", "trtllm-serve-config", "--target", str(DEMO_TARGET)]
        + ["--drafter", str(DEMO_DRAFTER), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "trtllm-serve " in run.stdout and f"--config {out}" in run.stdout
    loaded = yaml.safe_load(out.read_text())  # what trtllm-serve does with --config (commands/serve.py)
    assert set(loaded) <= LLM_ARGS_KEYS_WE_WRITE
    spec = loaded["speculative_config"]
    assert set(spec) <= DFLASH_DECODING_CONFIG_FIELDS, set(spec) - DFLASH_DECODING_CONFIG_FIELDS
    drafter = json.loads((DEMO_DRAFTER / "config.json").read_text())
    assert spec == {
        "decoding_type": "DFlash",
        "max_draft_len": drafter["block_size"] - 1,  # slot 0 of the block is the anchor token
        "speculative_model": str(DEMO_DRAFTER.resolve()),
        "target_layer_ids": drafter["dflash_config"]["target_layer_ids"],
        "mask_token_id": drafter["dflash_config"]["mask_token_id"],
    }
    check_like_decoding_base_config(spec)


def test_field_list_check_would_catch_a_wrong_key():
    """Negative control: a key DFlashDecodingConfig lacks (a StrictBaseModel refuses extra keys) is caught."""
    spec = dict(serve_config(DEMO_DRAFTER)["speculative_config"], block_size=8)
    assert set(spec) - DFLASH_DECODING_CONFIG_FIELDS == {"block_size"}


def test_our_drafter_folders_load_as_trtllm_dflash_drafters():
    # models/smollm2-drafter, when restored (docs/training.md), is checked too: the same published format
    folders = [DEMO_DIR / "drafter"] + [p for p in [DEMO_DIR / "smollm2-drafter"] if (p / "config.json").is_file()]
    for folder in folders:
        assert drafter_problems(folder) == [], folder


@pytest.fixture
def tiny_drafter(tmp_path):
    target = make_tiny_target(None, vocab_size=64, layers=4)
    make_tiny_drafter(target.config, tmp_path / "d", layers=2, block_size=4)
    return tmp_path / "d"


def test_a_freshly_saved_drafter_loads_as_it_is(tiny_drafter):
    assert drafter_problems(tiny_drafter) == []
    spec = serve_config(tiny_drafter)["speculative_config"]
    assert spec["max_draft_len"] == 3 and spec["mask_token_id"] == 63


def test_loader_expectations_are_checked(tiny_drafter, tmp_path):
    cfg = json.loads((tiny_drafter / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    del cfg["block_size"]
    cfg["dflash_config"].pop("block_size", None)  # the loader reads dflash_config's block_size first
    (tiny_drafter / "config.json").write_text(json.dumps(cfg))
    problems = drafter_problems(tiny_drafter)
    assert any("mask_token_id" in p for p in problems) and any("block_size" in p for p in problems)
    with pytest.raises(ServeConfigError, match="would not load"):
        serve_config(tiny_drafter)


def test_weights_out_of_place_are_caught(tiny_drafter):
    from safetensors.torch import load_file, save_file

    path = next(tiny_drafter.glob("*.safetensors"))
    weights = load_file(path)
    weights["layers.5.mlp.up_proj.weight"] = weights.pop("layers.1.mlp.up_proj.weight")
    weights["extra_head.weight"] = weights["fc.weight"].clone()
    del weights["hidden_norm.weight"]
    save_file(weights, path)
    problems = drafter_problems(tiny_drafter)
    assert any("hidden_norm.weight" in p for p in problems)
    assert any("'extra_head.weight'" in p for p in problems)
    assert any("layers [0, 1, 5]" in p for p in problems)


def demo_identity(tp=1, engine=TRTLLM_ENGINE, dtype="float16", **shape):
    """A grid identity of the demo target (a float16 checkpoint) as trtllm-serve would run it, unless told."""
    ident = grid_identity(read_target_config(DEMO_TARGET), dtype=dtype, engine=engine, tp=tp, gpu="test GPU")
    ident["target"].update(shape)
    return ident


def grid(target_per_token: float, rows=(1, 4, 16, 64, 256), context=512, identity=None):
    """A synthetic cost grid of the demo target: target fixed 10 ms + per_token x tokens, drafter fixed 2 ms +
    0.001 ms x tokens."""
    entries = {"identity": identity or demo_identity(), "target": [], "drafter": []}
    for r in rows:
        for t in (1, 4, 8):
            entries["target"].append(
                {"rows": r, "tokens_per_row": t, "context": context, "seconds": 0.010 + target_per_token * r * t}
            )
            entries["drafter"].append(
                {"rows": r, "tokens_per_row": t, "context": context, "seconds": 0.002 + 1e-6 * r * t}
            )
    return entries


def test_memory_bound_target_drafts_the_whole_block_at_every_batch_size(tmp_path):
    (tmp_path / "grid.json").write_text(json.dumps(grid(target_per_token=1e-7)))
    spec = serve_config(DEMO_DRAFTER, cost_table=tmp_path / "grid.json", tau=4.0, target_dir=DEMO_TARGET)[
        "speculative_config"
    ]
    assert spec["max_draft_len"] == 7 and "draft_len_schedule" not in spec and "max_concurrency" not in spec
    check_like_decoding_base_config(spec)


def test_compute_bound_target_drafts_less_as_the_batch_grows(tmp_path):
    (tmp_path / "grid.json").write_text(json.dumps(grid(target_per_token=2e-5)))
    spec = serve_config(DEMO_DRAFTER, cost_table=tmp_path / "grid.json", tau=4.0, target_dir=DEMO_TARGET)[
        "speculative_config"
    ]
    check_like_decoding_base_config(spec)
    schedule = spec["draft_len_schedule"]  # lengths differ between batch sizes: not one max_concurrency
    lengths = [schedule[b] for b in sorted(schedule)]
    assert lengths == sorted(lengths, reverse=True) and lengths[-1] < lengths[0] == 7
    yaml_text = to_yaml({"speculative_config": spec})
    assert yaml.safe_load(yaml_text)["speculative_config"] == spec  # int keys survive the YAML


def test_schedule_picks_the_best_rate_per_batch_size():
    target = EngineCost(fixed=0.010, per_token=2e-4)
    drafter = EngineCost(fixed=0.002, per_token=1e-6)
    best = schedule_from_costs(target, drafter, alpha=0.8, block_size=8, batch_sizes=[1, 64, 512])
    assert best[1] == 7 and best[512] == 0 and best[1] >= best[64] >= best[512]
    assert speculation_limits({1: 5, 4: 3, 16: 3, 64: 0}) == {"max_draft_len": 5, "draft_len_schedule": {1: 5, 16: 3}}
    assert speculation_limits({1: 5, 4: 5, 16: 0}) == {"max_draft_len": 5, "max_concurrency": 4}
    with pytest.raises(ServeConfigError, match="drafting pays at no measured batch size"):
        speculation_limits({1: 0, 8: 0})


def test_cost_table_needs_tau(tmp_path):
    (tmp_path / "grid.json").write_text(json.dumps(grid(1e-7)))
    with pytest.raises(ServeConfigError, match="--tau"):
        serve_config(DEMO_DRAFTER, cost_table=tmp_path / "grid.json")
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize(
    "identity, message",
    [
        (demo_identity(layers=32, hidden=4096), "layers 32 \\(grid\\) != 8 \\(target\\); hidden 4096"),
        (demo_identity(vocab=128256), "vocab 128256"),
        (demo_identity(tp=2), "tp 2 \\(grid\\) != 1 \\(serving\\)"),
    ],
)
def test_a_grid_of_another_target_is_refused(tmp_path, identity, message):
    (tmp_path / "grid.json").write_text(json.dumps(grid(1e-7, identity=identity)))
    with pytest.raises(ServeConfigError, match="measured on another target") as err:
        serve_config(DEMO_DRAFTER, cost_table=tmp_path / "grid.json", tau=4.0, target_dir=DEMO_TARGET)
    assert err.match(message) and "gpu_bare.py --grid-target" in str(err.value)


@pytest.mark.parametrize(
    "identity, message",
    [
        (demo_identity(engine="torch"), "engine torch \\(grid\\) != tensorrt-llm \\(serving\\)"),
        (demo_identity(dtype="float32"), "dtype float32 \\(grid\\) != float16 \\(serving\\)"),
        (demo_identity(engine="torch", dtype="bf16"), "engine torch .*; dtype bf16 \\(grid\\) != float16"),
    ],
)
def test_a_grid_of_another_engine_or_dtype_is_refused(tmp_path, identity, message):
    """An eager PyTorch grid (what gpu_bare.py measures) or one of another dtype: the target's shape and tp
    match, its pass times still are not TensorRT-LLM's in the checkpoint's dtype."""
    (tmp_path / "grid.json").write_text(json.dumps(grid(1e-7, identity=identity)))
    with pytest.raises(ServeConfigError, match="another engine or dtype") as err:
        serve_config(DEMO_DRAFTER, cost_table=tmp_path / "grid.json", tau=4.0, target_dir=DEMO_TARGET)
    assert err.match(message)


def test_dtype_spellings_are_one_dtype(tmp_path):
    (tmp_path / "grid.json").write_text(json.dumps(grid(1e-7, identity=demo_identity(dtype="fp16"))))
    cfg = serve_config(DEMO_DRAFTER, cost_table=tmp_path / "grid.json", tau=4.0, target_dir=DEMO_TARGET)
    assert cfg["speculative_config"]["max_draft_len"] >= 1


def test_a_grid_without_identity_or_without_target_is_refused(tmp_path):
    raw = grid(1e-7)
    del raw["identity"]
    (tmp_path / "grid.json").write_text(json.dumps(raw))
    with pytest.raises(ServeConfigError, match="records no identity"):
        serve_config(DEMO_DRAFTER, cost_table=tmp_path / "grid.json", tau=4.0, target_dir=DEMO_TARGET)
    with pytest.raises(ServeConfigError, match="--target"):
        serve_config(DEMO_DRAFTER, cost_table=tmp_path / "grid.json", tau=4.0)


def test_cli_refuses_a_grid_of_another_target(tmp_path):
    (tmp_path / "grid.json").write_text(json.dumps(grid(1e-7, identity=demo_identity(heads=32))))
    cmd = [sys.executable, "-m", "dflash_trt.cli", "trtllm-serve-config", "--target", str(DEMO_TARGET)]
    cmd += ["--drafter", str(DEMO_DRAFTER), "--cost-table", str(tmp_path / "grid.json"), "--tau", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "measured on another target" in proc.stderr and "heads 32" in proc.stderr
    (tmp_path / "grid.json").write_text(json.dumps(grid(1e-7, identity=demo_identity(engine="torch"))))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "engine torch (grid) != tensorrt-llm (serving)" in proc.stderr


# ---- DFlash 2 and the new target families (TensorRT-LLM pull request 18155's loader, see trtllm_serve.py) ----
def save_reference_dflash2(folder, hidden=32, vocab=64, layers=2, **dflash):
    """A DFlash 2 drafter written by z-lab's own class (dflash 0.1.0, DFlash2DraftModel.save_pretrained)."""
    model_module = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    recipe = {"target_layer_ids": [1, 2], "mask_token_id": vocab - 1, "block_size": 4, "conv_kernel_size": 2}
    recipe.update({"conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4, **dflash})
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        architectures=["DFlash2DraftModel"],
        num_target_layers=4,
        dflash_config=recipe,
    )
    model_module.DFlash2DraftModel(cfg).save_pretrained(folder)
    return folder


def published_spelling(folder):
    """Rename the codebooks as z-lab publishes them (no `.weight`; the reference's from_pretrained maps them)."""
    from safetensors.torch import load_file, save_file

    path = next(folder.glob("*.safetensors"))
    weights = load_file(path)
    for name in ("predecessor_codebook", "successor_codebook"):
        weights[f"candidate_selector.{name}"] = weights.pop(f"candidate_selector.{name}.weight")
    save_file(weights, path)
    return folder


def test_dflash2_checkpoint_loads_in_the_published_spelling(tmp_path):
    saved = save_reference_dflash2(tmp_path / "d")
    problems = drafter_problems(saved)
    assert len(problems) == 2 and all("must be named candidate_selector." in p for p in problems), problems
    published_spelling(saved)
    assert drafter_problems(saved) == []
    spec = serve_config(saved)["speculative_config"]
    assert set(spec) <= DFLASH_DECODING_CONFIG_FIELDS and spec["max_draft_len"] == 3  # block_size in dflash_config
    check_like_decoding_base_config(spec)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(selector_top_k=1), "selector_top_k < 2"),
        (dict(conv_group_size=0), "no dflash_config.conv_group_size"),
        (dict(conv_group_size=5), "does not divide hidden_size"),
    ],
)
def test_dflash2_recipe_is_checked_as_the_loader_validates_it(tmp_path, change, message):
    folder = published_spelling(save_reference_dflash2(tmp_path / "d"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dflash_config"].update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    assert any(message in p for p in drafter_problems(folder)), drafter_problems(folder)


def test_dflash2_weight_shapes_are_checked(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = published_spelling(save_reference_dflash2(tmp_path / "d"))
    path = next(folder.glob("*.safetensors"))
    weights = load_file(path)
    weights["layers.1.mlp_conv.base_kernel"] = weights["layers.1.mlp_conv.base_kernel"][:, :1].contiguous()
    del weights["layers.0.attention_conv.kernel_projection.weight"]
    save_file(weights, path)
    problems = drafter_problems(folder)
    assert any("layers.1.mlp_conv.base_kernel has shape [2, 1, 32]" in p for p in problems), problems
    assert any("lack layers.0.attention_conv.kernel_projection.weight" in p for p in problems), problems


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
def test_target_families_are_read_through_their_text_config(tmp_path, family):
    """Real transformers configs of multimodal-wrapped families: the drafter's layers and fc width are checked
    against text_config; a target too shallow for the feature layers is refused."""
    from transformers import AutoConfig

    drafter = published_spelling(save_reference_dflash2(tmp_path / "d"))
    text = dict(hidden_size=32, num_hidden_layers=4, vocab_size=64)
    AutoConfig.for_model(family, text_config=text).save_pretrained(tmp_path / "t")
    assert target_problems(tmp_path / "t", drafter) == []
    assert serve_config(drafter, target_dir=tmp_path / "t")["speculative_config"]["max_draft_len"] == 3
    AutoConfig.for_model(family, text_config={**text, "num_hidden_layers": 2, "hidden_size": 16}).save_pretrained(
        tmp_path / "small"
    )
    problems = target_problems(tmp_path / "small", drafter)
    assert any("target_layer_ids [2] outside the target's 2 layers" in p for p in problems), problems
    assert any("fc takes 64 features" in p for p in problems), problems


def test_cli_says_the_default_attention_backend_needs_flash_attn(tmp_path):
    def run(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "dflash_trt.cli", "trtllm-serve-config", "--target", str(DEMO_TARGET)]
            + ["--drafter", str(DEMO_DRAFTER), *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    default = run()
    assert "flash-attn" in default and "attention_backend" not in yaml.safe_load(default)["speculative_config"]
    blackwell = run("--attention-backend", "TRTLLM")
    assert "flash-attn" not in blackwell and "FlashInfer" in blackwell  # DFlashDecodingConfig.attention_backend
    assert yaml.safe_load(blackwell)["speculative_config"]["attention_backend"] == "TRTLLM"
    help_text = subprocess.run(
        [sys.executable, "-m", "dflash_trt.cli", "trtllm-serve-config", "--help"], capture_output=True, text=True
    ).stdout
    assert "flash-attn" in help_text and "Blackwell" in help_text
