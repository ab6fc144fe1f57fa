"""TensorRT drafter engine: runs the plan built by `dflash-trt build-drafter`.

Written against the real TensorRT 10/11 Python API, never run in this project (no TensorRT / TensorRT-LLM /
GPU here); tests drive it with a fake `tensorrt` module (tests/fake_tensorrt.py).

Per round: set_input_shape for every input, read the output shapes TensorRT infers, bind every
tensor by NAME with set_tensor_address, execute_async_v3 on torch's current CUDA stream. The
context cache stays on the GPU between rounds (present_k of one round is past_k of the next).
A DFlash 2 plan (built from its ONNX graph, builders/onnx_drafter.py) also outputs the candidate selector's
candidates and scores; the path through them is walked beside the plan, on the GPU, as for ONNX Runtime.
`tensorrt` is imported only when an engine is created.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..formats import PRECISION_DTYPES, DrafterGraphMeta, plan_max_context, read_plan_manifest
from ..models.selector import greedy_path
from .base import Draft, DrafterSession, EngineOptions, EngineUnavailable
from .rows import PerRowDrafter


def import_tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError as e:
        raise EngineUnavailable(
            "building or running a TensorRT drafter needs the `tensorrt` package (10.x or 11.x): "
            "pip install 'dflash-trt[gpu]' on a machine with an NVIDIA GPU, or use the TensorRT-LLM container"
        ) from e
    return tensorrt


def _torch_dtype(trt: Any, dtype: Any) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.int32: torch.int32, trt.int64: torch.int64}
    if hasattr(trt, "bfloat16"):
        table[trt.bfloat16] = torch.bfloat16
    return table[dtype]


class TrtDrafterEngine:
    name = "tensorrt"

    def __init__(self, folder: str | Path, device: str = "cuda"):
        trt = import_tensorrt()
        self.trt = trt
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise EngineUnavailable("the TensorRT drafter needs an NVIDIA GPU, and torch sees none")
        folder = Path(folder)
        manifest = read_plan_manifest(folder)
        if manifest["tensorrt_version"] != str(trt.__version__):
            raise EngineUnavailable(
                f"{folder / manifest['plan']} was built with TensorRT {manifest['tensorrt_version']}, this is "
                f"{trt.__version__}: rebuild it with `make engines` (plans do not move across versions)"
            )
        self.meta = DrafterGraphMeta.read(folder)
        self.manifest = manifest
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine((folder / manifest["plan"]).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT could not load {folder / manifest['plan']} (GPU or version mismatch?)")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.dtypes = {n: _torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in names}
        self.block_size = self.meta.block_size
        self.mask_token_id = self.meta.mask_token_id
        self.feature_layer_ids = self.meta.feature_layer_ids
        # The plan's profile caps the cache length T; the loop refuses longer requests up front.
        self.max_context: int | None = plan_max_context(manifest)
        self.dtype = PRECISION_DTYPES[manifest["precision"]]  # what builders/trt_drafter.py built it in

    @classmethod
    def from_artifact(cls, folder: Path, options: EngineOptions) -> TrtDrafterEngine:
        return cls(folder, options.device or "cuda")

    def new_session(self) -> DrafterSession:
        """Rows in turn, one execution context each (the batched plan is not served yet)."""
        return PerRowDrafter(lambda: TrtDrafterSequence(self))


class TrtDrafterSequence:
    """One sequence, one execution context: contexts hold shapes and addresses, so sequences must not share one."""

    def __init__(self, engine: TrtDrafterEngine):
        self.engine = engine
        # The default STATIC allocation strategy: the context allocates its activation memory now, the largest
        # profile's (ICudaEngine.device_memory_size_v2, TensorRT 10.1+ / 11), and keeps it for its lifetime; one
        # context per row, so runtime/trtllm_memory.py counts it once per row in the executor's memory plan.
        self.context = engine.engine.create_execution_context()
        if self.context is None:
            raise RuntimeError("TensorRT could not create an execution context (out of GPU memory?)")
        shape = engine.meta.cache_shape(0)
        self.past_k = torch.zeros(shape, dtype=engine.dtypes["past_k"], device=engine.device)
        self.past_v = torch.zeros(shape, dtype=engine.dtypes["past_v"], device=engine.device)
        # TensorRT wants a valid address even for an empty tensor (the first round's cache).
        self._scratch = torch.zeros(64, dtype=torch.uint8, device=engine.device)

    @property
    def context_length(self) -> int:
        return self.past_k.shape[3]

    def _address(self, t: torch.Tensor) -> int:
        return t.data_ptr() if t.numel() else self._scratch.data_ptr()

    @torch.inference_mode()
    def draft(self, new_features: torch.Tensor, last_token: int, block_size: int) -> Draft:
        e, ctx = self.engine, self.context
        block = torch.full((1, block_size), e.mask_token_id, dtype=e.dtypes["block_ids"], device=e.device)
        block[0, 0] = last_token
        feats = new_features.to(device=e.device, dtype=e.dtypes["features"]).unsqueeze(0).contiguous()
        feeds = {"block_ids": block, "features": feats, "past_k": self.past_k, "past_v": self.past_v}
        for name in e.inputs:
            # set_input_shape returns False (and keeps the old shape) for a shape outside the plan's optimization
            # profile (TensorRT 10 Python API, IExecutionContext.set_input_shape); unchecked, the output shapes
            # read next would be inferred from stale or unset inputs
            if not ctx.set_input_shape(name, tuple(feeds[name].shape)):
                raise ValueError(
                    f"TensorRT refused {name} of shape {tuple(feeds[name].shape)}: outside the plan's optimization "
                    f"profile (context cache up to {e.max_context} tokens); rebuild the plan with a larger "
                    "max_context (`make engines`), or keep requests within it"
                )
            ctx.set_tensor_address(name, self._address(feeds[name]))
        results = {}
        for name in e.outputs:
            shape = tuple(ctx.get_tensor_shape(name))  # inferred from the input shapes just set
            results[name] = torch.empty(shape, dtype=e.dtypes[name], device=e.device)
            ctx.set_tensor_address(name, self._address(results[name]))
        stream = torch.cuda.current_stream(e.device).cuda_stream if e.device.type == "cuda" else 0
        if not ctx.execute_async_v3(stream):
            raise RuntimeError("TensorRT drafter execution failed")
        self.past_k, self.past_v = results["present_k"], results["present_v"]
        draft = Draft(logits=results["logits"][0].float(), tokens=results["draft_tokens"][0].long())
        if "candidates" in results:  # a DFlash 2 plan: the selector's path is walked here, beside the plan
            draft.candidates, draft.step_scores = results["candidates"][0].long(), results["step_scores"][0].float()
            draft.tokens = greedy_path(draft.candidates, draft.step_scores)
        return draft
