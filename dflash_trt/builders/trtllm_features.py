"""Model classes for `trtllm-build --model_cls_file THIS --model_cls_name ...` (imported by trtllm-build only).

They are TensorRT-LLM's own LLaMA / QWen causal LMs, plus engine outputs:
  * `dflash_feature_{i}`: the output hidden state of decoder layer i for each i in the checkpoint config's
    `dflash_feature_layer_ids` ([num_tokens, hidden], the full hidden size on every tensor-parallel rank since
    each layer ends after its all-reduce): "the output of decoder layer i", as Hugging Face `hidden_states[i + 1]`;
  * `dflash_final_hidden`: the output of the final norm `ln_f` for every token. The engine is built without
    `--gather_context_logits` (that would switch KV block reuse off), so the orchestrator computes the
    verification logits from this tensor and the target's lm_head weights.
The runtime returns them as `context_<name>` when requested with `AdditionalModelOutput(name,
gather_context=True)`. `Tensor.mark_output(name, dtype)` is tensorrt_llm/functional.py (1.2); the `transformer.layers`
/ `transformer.ln_f` attributes are tensorrt_llm/models/llama/model.py and models/qwen/model.py (1.2).
Pipeline parallelism is refused (layer ids would be rank-local).

NOT RUN on real hardware in this project (no TensorRT / TensorRT-LLM / GPU here).
"""

from typing import Any

from tensorrt_llm.models import LLaMAForCausalLM, QWenForCausalLM

# tensorrt_llm is not installed here (and untyped): its modules, configs and tensors are Any; the model
# classes below subclass it, hence their `type: ignore[misc]` (subclassing Any).

FINAL_HIDDEN_OUTPUT = "dflash_final_hidden"  # = trtllm_target.FINAL_HIDDEN_OUTPUT (this file is loaded standalone)


def _mark(module: Any, name: str, dtype: Any) -> None:
    original = module.forward

    def forward(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
        out = _original(*args, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        hidden.mark_output(name, dtype)
        return out

    object.__setattr__(module, "forward", forward)  # Module.__setattr__ would try to register it


def _mark_outputs(model: Any, config: Any) -> None:
    layer_ids = list(getattr(config, "dflash_feature_layer_ids", None) or [])
    if not layer_ids:
        raise ValueError(
            "checkpoint config has no dflash_feature_layer_ids: convert with dflash_trt.builders.trtllm_convert"
        )
    if config.mapping.pp_size != 1:
        raise ValueError("DFlash feature outputs need pp_size == 1 (use tensor parallelism)")
    for i in layer_ids:
        _mark(model.transformer.layers[i], f"dflash_feature_{i}", config.dtype)
    _mark(model.transformer.ln_f, FINAL_HIDDEN_OUTPUT, config.dtype)


class DFlashLLaMAForCausalLM(LLaMAForCausalLM):  # type: ignore[misc]
    def __init__(self, config: Any):
        super().__init__(config)
        _mark_outputs(self, config)


class DFlashQWenForCausalLM(QWenForCausalLM):  # type: ignore[misc]
    def __init__(self, config: Any):
        super().__init__(config)
        _mark_outputs(self, config)
