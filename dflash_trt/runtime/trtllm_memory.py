"""The KV-cache share of GPU memory for the TensorRT-LLM executor, leaving room for what the leader rank loads after it.

TensorRT-LLM 1.2 sizes its paged KV cache when the Executor is created: `KvCacheConfig.free_gpu_memory_fraction`
of the GPU memory still free once the engine's weights and runtime buffers are in place
(cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp, calculateMaxNumBlocks /
BaseKVCacheManager::calculateFreeMemBytes), and keeps it for the executor's lifetime. On the same GPU the leader
rank then loads the target's lm_head (vocab x hidden) for verification logits and the drafter: its weights and one
TensorRT execution context per row (runtime/trt_backend.py), each with its own context cache and block logits and
the activation memory TensorRT allocates for it: ICudaEngine.device_memory_size_v2 (TensorRT 10.1+ / 11 Python API),
which a context created with the default STATIC ExecutionContextAllocationStrategy takes whole, sized for the
largest optimization profile (IRuntimeConfig docs: "static allocation with the maximum size across all profiles"),
recorded in the plan's manifest at build time (builders/trt_drafter.py) as `context_device_memory`. A fixed share leaves the
leader whatever is left over: for a large target with a large vocabulary the lm_head and the rows' drafter caches
need more, and the leader would run out of memory after the executor started. The fraction here is computed from
what the leader still has to load, capped at FRACTION_CAP (non-leader ranks load nothing and keep the cap), floored
at FRACTION_FLOOR, below which the KV cache would hold too few blocks to serve: then a clear error instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..formats import DrafterGraphMeta, read_manifest, read_plan_manifest

GIB = 2**30
FRACTION_CAP = 0.85  # the executor's share when nothing else loads on its GPU
FRACTION_FLOOR = 0.05  # less than this for the KV cache is no serving configuration: refuse
HEADROOM_BYTES = GIB  # the leader's CUDA context, allocator slack and per-round tensors of the decoding loop
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}


class MemoryPlanError(RuntimeError):
    """The leader's loads do not fit beside the engine on its GPU (the message gives the figures)."""


@dataclass(frozen=True)
class LeaderLoad:
    """Bytes the leader rank allocates on its GPU after the executor took its KV cache."""

    lm_head: int = 0
    drafter_weights: int = 0
    contexts: int = 0  # drafter execution contexts: one per row
    per_context: int = 0

    @property
    def total(self) -> int:
        return self.lm_head + self.drafter_weights + self.contexts * self.per_context + HEADROOM_BYTES

    def describe(self) -> str:
        return (
            f"lm_head {self.lm_head / GIB:.2f} GiB, drafter weights {self.drafter_weights / GIB:.2f} GiB, "
            f"{self.contexts} drafter contexts x {self.per_context / GIB:.3f} GiB, headroom {HEADROOM_BYTES / GIB:.0f} GiB"
        )


def lm_head_bytes(vocab: int, hidden: int, dtype_bytes: int) -> int:
    return vocab * hidden * dtype_bytes


def drafter_context_bytes(meta: DrafterGraphMeta, dtype_bytes: int, activation_bytes: int = 0) -> int:
    """One row's drafter allocations: its context cache as past and present K and V (all layers, up to the plan's
    max_context), its block's logits in float32, and its execution context's activation memory (`activation_bytes`:
    the plan manifest's context_device_memory, for the largest profile)."""
    cache = 2 * 2 * meta.num_layers * meta.num_kv_heads * meta.max_context * meta.head_dim * dtype_bytes
    return cache + meta.block_size * meta.vocab_size * 4 + activation_bytes


def context_activation_bytes(manifest: dict[str, Any], folder: Path) -> int:
    """The activation memory of one execution context of the plan in `folder`, as its build recorded it."""
    if "context_device_memory" not in manifest:
        raise MemoryPlanError(
            f"{folder} records no context_device_memory (the device memory each of the drafter's execution "
            "contexts allocates): the plan was built before it was recorded; rebuild it (`make engines`) so that "
            "the executor's memory plan can count one context per row"
        )
    return int(manifest["context_device_memory"])


def kv_cache_fraction(free_bytes: int, engine_bytes: int, leader: LeaderLoad) -> float:
    """free_gpu_memory_fraction for the executor: the share of the memory free after the engine (free_bytes now,
    before the executor loads, minus this rank's engine) that leaves the leader's loads room, capped and floored."""
    after_engine = free_bytes - engine_bytes
    if after_engine <= 0:
        raise MemoryPlanError(
            f"the engine ({engine_bytes / GIB:.1f} GiB on this rank) does not fit the {free_bytes / GIB:.1f} GiB free "
            "on its GPU: build it at a larger tp"
        )
    fraction = min(FRACTION_CAP, (after_engine - leader.total) / after_engine)
    if fraction < FRACTION_FLOOR:
        raise MemoryPlanError(
            f"after the engine {after_engine / GIB:.1f} GiB stay free on the leader's GPU, and the leader needs "
            f"{leader.total / GIB:.1f} GiB of it ({leader.describe()}), leaving the KV cache less than "
            f"{FRACTION_FLOOR:.0%}: build the target at a larger tp, serve fewer rows (max_batch_size), or a drafter "
            "plan with a shorter max_context"
        )
    return fraction


def leader_load(target_folder: Path, engine_config: dict[str, Any]) -> LeaderLoad:
    """What the leader loads for this engines folder: the lm_head at the engine's dtype, and the TensorRT drafter
    of the folder's manifest (plan file + one context per row, max_batch_size rows, each with its cache, logits and
    activation memory) when that is what it serves."""
    pretrained = engine_config.get("pretrained_config", {})
    dsize = DTYPE_BYTES.get(str(pretrained.get("dtype", "float16")), 2)
    head = lm_head_bytes(int(pretrained["vocab_size"]), int(pretrained["hidden_size"]), dsize)
    rows = int(engine_config.get("build_config", {}).get("max_batch_size", 1))
    manifest = read_manifest(target_folder.parent)
    drafter = manifest.get("engines", {}).get(manifest.get("serve", {}).get("drafter", ""), {})
    if drafter.get("backend") != "tensorrt":
        return LeaderLoad(lm_head=head)
    folder = target_folder.parent / drafter["dir"]
    plan_manifest = read_plan_manifest(folder)
    plan = folder / plan_manifest["plan"]
    activation = context_activation_bytes(plan_manifest, folder)
    per_row = drafter_context_bytes(DrafterGraphMeta.read(folder), dsize, activation)
    return LeaderLoad(head, plan.stat().st_size, rows, per_row)


def rank_engine_bytes(engine_dir: Path, rank: int) -> int:
    path = Path(engine_dir) / f"rank{rank}.engine"  # trtllm-build's file per rank
    return path.stat().st_size if path.is_file() else 0
