"""STAND-IN for tensorrt_llm.models (NVIDIA/TensorRT-LLM 008b2b8d, tensorrt_llm/models/modeling_utils.py): a model
class's `from_hugging_face(model_dir, dtype, mapping=...)` reads the Hugging Face checkpoint, and
`save_checkpoint(output_dir, save_config)` writes `rank{r}.safetensors` and, with save_config, `config.json` (the
pretrained config with its mapping). Here the rank file holds the Hugging Face checkpoint's own files (a tar), so
that the stand-in engine built from it computes what that checkpoint computes."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path


class _Model:
    def __init__(self, model_dir: str, dtype: str, mapping):
        self.model_dir, self.dtype, self.mapping = Path(model_dir), dtype, mapping
        self.hf_config = json.loads((self.model_dir / "config.json").read_text())

    @classmethod
    def from_hugging_face(cls, model_dir, dtype="float16", mapping=None, **kw):
        return cls(model_dir, dtype, mapping)

    def save_checkpoint(self, output_dir: str, save_config: bool = True) -> None:
        out = Path(output_dir)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for f in sorted(self.model_dir.iterdir()):
                if f.is_file():
                    tar.add(f, arcname=f.name)
        (out / f"rank{self.mapping.rank}.safetensors").write_bytes(buf.getvalue())
        if save_config:
            text = self.hf_config.get("text_config") or self.hf_config
            config = {
                "architecture": type(self).__name__,
                "dtype": self.dtype,
                "vocab_size": text["vocab_size"],
                "hidden_size": text["hidden_size"],
                "num_hidden_layers": text["num_hidden_layers"],
                "mapping": self.mapping.to_dict(),
            }
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


class LLaMAForCausalLM(_Model):
    pass


class QWenForCausalLM(_Model):
    pass
