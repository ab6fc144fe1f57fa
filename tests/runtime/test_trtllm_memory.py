"""The executor's KV-cache fraction leaves room for what the leader loads after it (runtime/trtllm_memory.py): the
arithmetic at a 70B-like shape with a 128k vocabulary, where the former fixed 0.85 ran the leader out of memory."""

import json

import pytest

from dflash_trt.formats import DrafterGraphMeta
from dflash_trt.runtime.trtllm_memory import (
    FRACTION_CAP,
    FRACTION_FLOOR,
    GIB,
    HEADROOM_BYTES,
    LeaderLoad,
    MemoryPlanError,
    drafter_context_bytes,
    kv_cache_fraction,
    leader_load,
    lm_head_bytes,
)

# Llama-3-70B (hidden 8192, 128256 tokens, 8 KV heads of 128), fp16, tp 8 on 80 GB GPUs; a 5-layer drafter at its
# width whose plan is about 10 GB, 64 rows, contexts up to 8192.
VOCAB, HIDDEN = 128256, 8192
DRAFTER = DrafterGraphMeta(
    block_size=16,
    mask_token_id=VOCAB - 1,
    feature_layer_ids=(1, 20, 40, 60, 78),
    feature_size=5 * HIDDEN,
    num_layers=5,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=VOCAB,
    max_context=8192,
)
GPU = 80 * 10**9
ENGINE_PER_RANK = 140 * 10**9 // 8


def seventy_b_leader() -> LeaderLoad:
    return LeaderLoad(lm_head_bytes(VOCAB, HIDDEN, 2), 10 * 10**9, 64, drafter_context_bytes(DRAFTER, 2))


def test_lm_head_and_drafter_contexts_at_a_70b_shape():
    assert lm_head_bytes(VOCAB, HIDDEN, 2) == 2_101_346_304  # 128256 x 8192 x 2 B: about 2 GB
    per_row = drafter_context_bytes(DRAFTER, 2)
    assert per_row == 2 * 2 * 5 * 8 * 8192 * 128 * 2 + 16 * VOCAB * 4  # K and V, past and present; fp32 logits
    leader = seventy_b_leader()
    assert leader.total == leader.lm_head + 10 * 10**9 + 64 * per_row + HEADROOM_BYTES
    assert 32 * GIB < leader.total < 34 * GIB  # the 64 rows of drafter caches weigh most


def test_the_fraction_leaves_the_leader_what_it_loads_where_085_did_not():
    free_now = GPU - 2 * GIB  # the CUDA context and the loop's process before the executor starts
    leader = seventy_b_leader()
    after_engine = free_now - ENGINE_PER_RANK
    assert after_engine * (1 - 0.85) < leader.total  # the former fixed fraction: out of memory on the leader
    fraction = kv_cache_fraction(free_now, ENGINE_PER_RANK, leader)
    assert FRACTION_FLOOR <= fraction < 0.85
    assert after_engine * (1 - fraction) == pytest.approx(leader.total)  # exactly the leader's loads stay free
    # a rank that loads nothing beside its executor keeps the cap
    assert kv_cache_fraction(free_now, ENGINE_PER_RANK, LeaderLoad()) == FRACTION_CAP


def test_nothing_fits_gives_the_figures_and_what_to_change():
    leader = seventy_b_leader()
    with pytest.raises(MemoryPlanError, match=r"leaving the KV cache less than 5%.*larger tp"):
        kv_cache_fraction(GPU, 140 * 10**9 // 4 + 20 * 10**9, leader)  # tp 4, a busier GPU: 25 GB left for 35
    with pytest.raises(MemoryPlanError, match=r"the engine \(70.0 GiB on this rank\) does not fit"):
        kv_cache_fraction(40 * GIB, 70 * GIB, leader)


def test_leader_load_reads_the_engines_folder(tmp_path):
    """From a built folder: the lm_head at the engine's dtype, and the TensorRT drafter the manifest serves."""
    engines = tmp_path / "engines"
    (engines / "drafter-tensorrt").mkdir(parents=True)
    (engines / "drafter-tensorrt" / "drafter.plan").write_bytes(b"\0" * 4096)
    plan_manifest = {"plan": "drafter.plan", "context_device_memory": 3 * GIB}
    (engines / "drafter-tensorrt" / "drafter.plan.json").write_text(json.dumps(plan_manifest))
    (engines / "drafter-tensorrt" / "drafter.json").write_text(json.dumps(DRAFTER.to_dict()))
    manifest = {
        "engines": {"drafter_tensorrt": {"backend": "tensorrt", "dir": "drafter-tensorrt"}},
        "serve": {"drafter": "drafter_tensorrt", "target": "target_tensorrt_llm"},
    }
    (engines / "manifest.json").write_text(json.dumps(manifest))
    config = {"pretrained_config": {"vocab_size": VOCAB, "hidden_size": HIDDEN, "dtype": "bfloat16"}}
    config["build_config"] = {"max_batch_size": 64}
    load = leader_load(engines / "target-tensorrt_llm", config)
    # each of the 64 rows' execution contexts with its activation memory (the plan's record), not only its caches
    assert load == LeaderLoad(lm_head_bytes(VOCAB, HIDDEN, 2), 4096, 64, drafter_context_bytes(DRAFTER, 2) + 3 * GIB)
    assert load.total - LeaderLoad(load.lm_head, 4096, 64, drafter_context_bytes(DRAFTER, 2)).total == 64 * 3 * GIB
    del plan_manifest["context_device_memory"]  # a plan built before the figure was recorded: refused by name
    (engines / "drafter-tensorrt" / "drafter.plan.json").write_text(json.dumps(plan_manifest))
    with pytest.raises(MemoryPlanError, match="records no context_device_memory.*rebuild"):
        leader_load(engines / "target-tensorrt_llm", config)
    manifest["engines"]["drafter_tensorrt"]["backend"] = "onnxruntime"  # a CPU drafter: the lm_head only
    (engines / "manifest.json").write_text(json.dumps(manifest))
    assert leader_load(engines / "target-tensorrt_llm", config) == LeaderLoad(lm_head=lm_head_bytes(VOCAB, HIDDEN, 2))
