"""Model classes for `trtllm-build --model_cls_file THIS --model_cls_name ...` (imported by trtllm-build only).

They are TensorRT-LLM's own LLaMA / QWen causal LMs, plus: the output hidden states of the decoder
layers listed in the checkpoint config's `dflash_feature_layer_ids` are marked as engine outputs
`dflash_feature_{i}` ([num_tokens, hidden], the full hidden size on every tensor-parallel rank since
each layer ends after its all-reduce). That is "the output of decoder layer i", the same convention
as Hugging Face `hidden_states[i + 1]`. Pipeline parallelism is refused (layer ids would be local).
Written against the real API, never run in this project (no TensorRT / TensorRT-LLM / GPU here).
"""

from tensorrt_llm.models import LLaMAForCausalLM, QWenForCausalLM


def _mark_feature_layers(model, config) -> None:
    layer_ids = list(getattr(config, "dflash_feature_layer_ids", None) or [])
    if not layer_ids:
        raise ValueError("checkpoint config has no dflash_feature_layer_ids: convert with dflash_trt.builders.trtllm_convert")
    if config.mapping.pp_size != 1:
        raise ValueError("DFlash feature outputs need pp_size == 1 (use tensor parallelism)")
    layers = model.transformer.layers
    for i in layer_ids:
        layer = layers[i]
        original = layer.forward

        def forward(*args, _original=original, _name=f"dflash_feature_{i}", **kwargs):
            out = _original(*args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
            hidden.mark_output(_name, config.dtype)
            return out

        object.__setattr__(layer, "forward", forward)


class DFlashLLaMAForCausalLM(LLaMAForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        _mark_feature_layers(self, config)


class DFlashQWenForCausalLM(QWenForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        _mark_feature_layers(self, config)
