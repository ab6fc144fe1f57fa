"""HF checkpoint -> TensorRT-LLM checkpoint with tensor parallelism (run as a subprocess; needs tensorrt_llm).

One `rank{r}.safetensors` per rank from `<Cls>.from_hugging_face(model_dir, dtype, mapping=Mapping(
world_size=tp, rank=r, gpus_per_node=g, tp_size=tp))`, `save_checkpoint(out, save_config=(r == 0))`, then the
feature layers the engine must expose are recorded in config.json for trtllm_features.py to read at build.
`gpus_per_node` is the GPUs of one node (tensorrt_llm/mapping.py: Mapping's default 8, its node_rank / local_rank
rule rank // g, rank % g); to_dict() saves it in config.json and trtllm-build keeps it in the engine
(trtllm_target.py says why).
Written against the real API, never run in this project (no TensorRT / TensorRT-LLM / GPU here).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model_dir", required=True, help="Hugging Face target checkpoint")
    p.add_argument("--output_dir", required=True, help="TensorRT-LLM checkpoint folder to write")
    p.add_argument("--model_cls", required=True, choices=["LLaMAForCausalLM", "QWenForCausalLM"])
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--tp_size", type=int, default=1, help="tensor-parallel ranks (one per GPU)")
    p.add_argument("--gpus_per_node", type=int, default=None, help="GPUs of one node (default: tp_size, one node)")
    p.add_argument("--feature_layer_ids", required=True, help="comma-separated target layers the drafter reads")
    args = p.parse_args(argv)
    try:
        import tensorrt_llm.models as models
        from tensorrt_llm import Mapping
    except ImportError as e:
        raise SystemExit(f"checkpoint conversion needs tensorrt_llm 1.2 (NVIDIA's container): {e}") from None

    cls = getattr(models, args.model_cls)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for rank in range(args.tp_size):
        gpus = args.gpus_per_node or args.tp_size
        mapping = Mapping(world_size=args.tp_size, rank=rank, gpus_per_node=gpus, tp_size=args.tp_size)
        model = cls.from_hugging_face(args.model_dir, args.dtype, mapping=mapping)
        model.save_checkpoint(str(out), save_config=(rank == 0))
        del model
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["dflash_feature_layer_ids"] = [int(i) for i in args.feature_layer_ids.split(",")]
    config_path.write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
