"""Triton model configs as typed data, written through tritonclient's ModelConfig protobuf, and checked.

    tensor("text_input", "TYPE_STRING", [1], optional=True)      -> one input/output entry
    model_config(name, backend="python", inputs=..., outputs=..) -> model_config_pb2.ModelConfig
    write_config(folder, cfg)                                     -> folder/config.pbtxt (text_format)
    validate_repository(repo)                                     -> [] or a list of clear messages

Syntax and field names are checked by parsing each config.pbtxt back into ModelConfig (a
misspelled field is a ParseError naming it); the rest (version folders and their files, ensemble
maps that connect, dtypes and dims that agree between producer and consumer) is checked here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.pbtxt"
# What each platform/backend loads from <model>/<version>/ (python: model.py, tensorrt_plan: model.plan ...).
DEFAULT_FILES = {"python": "model.py", "tensorrt_plan": "model.plan", "onnxruntime_onnx": "model.onnx"}


class ConfigError(ValueError):
    pass


# tritonclient's protobuf modules are untyped: a model_config_pb2.ModelConfig message is Any here
ModelConfig = Any


def pb2() -> Any:  # the tritonclient.grpc.model_config_pb2 module
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        raise ConfigError(
            "Triton model configs need the `tritonclient` package: pip install 'dflash-trt[triton]'"
        ) from e
    return model_config_pb2


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # "TYPE_INT64", "TYPE_FP32", "TYPE_STRING", ...
    dims: tuple[int, ...]
    optional: bool = False


def tensor(name: str, dtype: str, dims: Iterable[int], optional: bool = False) -> Tensor:
    return Tensor(name, dtype, tuple(int(d) for d in dims), optional)


@dataclass(frozen=True)
class Step:
    """One ensemble step: model input name -> ensemble tensor, model output name -> ensemble tensor."""

    model: str
    input_map: dict[str, str]
    output_map: dict[str, str]


def model_config(
    name: str,
    *,
    backend: str | None = None,
    platform: str | None = None,
    max_batch_size: int = 0,
    inputs: Iterable[Tensor] = (),
    outputs: Iterable[Tensor] = (),
    parameters: dict[str, Any] | None = None,
    instance_kind: str | None = "KIND_CPU",
    instance_count: int = 1,
    instance_gpus: list[int] | None = None,
    decoupled: bool = False,
    dynamic_batching: bool = False,
    steps: list[Step] | None = None,
) -> ModelConfig:
    m = pb2()
    cfg = m.ModelConfig(name=name, max_batch_size=max_batch_size)
    if backend:
        cfg.backend = backend
    if platform:
        cfg.platform = platform
    for t in inputs:
        cfg.input.append(
            m.ModelInput(name=t.name, data_type=m.DataType.Value(t.dtype), dims=list(t.dims), optional=t.optional)
        )
    for t in outputs:
        cfg.output.append(m.ModelOutput(name=t.name, data_type=m.DataType.Value(t.dtype), dims=list(t.dims)))
    for key, value in (parameters or {}).items():
        text = value if isinstance(value, str) else json.dumps(value)
        cfg.parameters[key].string_value = text
    if steps is not None:
        for s in steps:
            step = cfg.ensemble_scheduling.step.add(model_name=s.model, model_version=-1)
            step.input_map.update(s.input_map)
            step.output_map.update(s.output_map)
    elif instance_kind:
        group = m.ModelInstanceGroup(kind=m.ModelInstanceGroup.Kind.Value(instance_kind), count=instance_count)
        # Triton (model_config.proto, ModelInstanceGroup.gpus): a KIND_GPU group without `gpus` places `count`
        # instances on EVERY visible GPU; with `gpus` only on those listed.
        group.gpus.extend(instance_gpus or [])
        cfg.instance_group.append(group)
    if decoupled:
        cfg.model_transaction_policy.decoupled = True
    if dynamic_batching:
        cfg.dynamic_batching.SetInParent()
    return cfg


def to_text(cfg: ModelConfig) -> str:
    from google.protobuf import text_format

    text: str = text_format.MessageToString(cfg)
    return text


def write_config(folder: Path, cfg: ModelConfig) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CONFIG_FILE
    path.write_text(to_text(cfg))
    return path


def parse_config(path: Path) -> ModelConfig:
    """config.pbtxt -> ModelConfig; a syntax error or an unknown field raises ConfigError naming the file."""
    from google.protobuf import text_format

    try:
        return text_format.Parse(path.read_text(), pb2().ModelConfig())
    except text_format.ParseError as e:
        raise ConfigError(f"{path}: {e}") from None


# ---- semantic checks ----------------------------------------------------------------------------


def _model_file(cfg: ModelConfig) -> str:
    if cfg.default_model_filename:
        name: str = cfg.default_model_filename
        return name
    return DEFAULT_FILES.get(cfg.platform or cfg.backend, "")


def _signature(
    cfg: ModelConfig, ensemble_max_batch: int
) -> tuple[dict[str, tuple[str, list[int]]], dict[str, tuple[str, list[int]]]]:
    """name -> (dtype, full dims) as an ensemble sees them (batch dim -1 prepended when batched)."""
    m = pb2()
    prefix = [-1] if cfg.max_batch_size > 0 else []
    ins = {t.name: (m.DataType.Name(t.data_type), prefix + list(t.dims)) for t in cfg.input}
    outs = {t.name: (m.DataType.Name(t.data_type), prefix + list(t.dims)) for t in cfg.output}
    return ins, outs


def _dims_agree(a: list[int], b: list[int]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _check_ensemble(name: str, cfg: ModelConfig, configs: dict[str, ModelConfig]) -> list[str]:
    errors: list[str] = []
    ens_in, ens_out = _signature(cfg, cfg.max_batch_size)
    produced = dict(ens_in)  # ensemble tensor -> (dtype, dims, producer)
    producers = {k: "ensemble input" for k in ens_in}
    consumed: set[str] = set()
    steps = list(cfg.ensemble_scheduling.step)
    if not steps:
        return [f"{name}: ensemble has no ensemble_scheduling steps"]
    # Steps may be listed in any order: resolve producers first.
    for step in steps:
        sub = configs.get(step.model_name)
        if sub is None:
            errors.append(f"{name}: step model {step.model_name!r} is not in the repository")
            continue
        if sub.max_batch_size < cfg.max_batch_size:
            errors.append(
                f"{name}: max_batch_size {cfg.max_batch_size} exceeds {step.model_name}'s {sub.max_batch_size}"
            )
        _, sub_out = _signature(sub, cfg.max_batch_size)
        for out_name, ens_name in step.output_map.items():
            if out_name not in sub_out:
                errors.append(
                    f"{name}: output_map of step {step.model_name!r} names output {out_name!r}, "
                    f"which {step.model_name} does not have (it has {sorted(sub_out)})"
                )
                continue
            if ens_name in producers:
                errors.append(
                    f"{name}: tensor {ens_name!r} is produced twice ({producers[ens_name]} and {step.model_name})"
                )
            produced[ens_name] = sub_out[out_name]
            producers[ens_name] = step.model_name
    for step in steps:
        sub = configs.get(step.model_name)
        if sub is None:
            continue
        sub_in, _ = _signature(sub, cfg.max_batch_size)
        for in_name, ens_name in step.input_map.items():
            consumed.add(ens_name)
            if in_name not in sub_in:
                errors.append(
                    f"{name}: input_map of step {step.model_name!r} names input {in_name!r}, "
                    f"which {step.model_name} does not have (it has {sorted(sub_in)})"
                )
                continue
            if ens_name not in produced:
                errors.append(
                    f"{name}: step {step.model_name!r} reads {ens_name!r}, which no ensemble input "
                    f"or step output provides (known: {sorted(produced)})"
                )
                continue
            (pd, pdims), (cd, cdims) = produced[ens_name], sub_in[in_name]
            if pd != cd:
                errors.append(
                    f"{name}: {ens_name!r} is {pd} from {producers[ens_name]} but {step.model_name} "
                    f"input {in_name!r} wants {cd}"
                )
            elif not _dims_agree(pdims, cdims):
                errors.append(
                    f"{name}: {ens_name!r} has dims {pdims} from {producers[ens_name]} but "
                    f"{step.model_name} input {in_name!r} wants {cdims}"
                )
        required = {t.name for t in sub.input if not t.optional}
        missing = required - set(step.input_map)
        if missing:
            errors.append(f"{name}: step {step.model_name!r} does not feed its required inputs {sorted(missing)}")
    for out_name, (dtype, dims) in ens_out.items():
        if out_name not in produced:
            errors.append(f"{name}: ensemble output {out_name!r} is produced by no step")
        elif produced[out_name][0] != dtype:
            errors.append(
                f"{name}: ensemble output {out_name!r} is {dtype} but {producers[out_name]} makes "
                f"{produced[out_name][0]}"
            )
        elif not _dims_agree(produced[out_name][1], dims):
            errors.append(
                f"{name}: ensemble output {out_name!r} has dims {dims} but {producers[out_name]} makes "
                f"{produced[out_name][1]}"
            )
    unused = sorted(set(ens_in) - consumed)
    if unused:
        errors.append(f"{name}: ensemble inputs {unused} are not read by any step")
    return errors


def validate_repository(repo: str | Path) -> list[str]:
    """Every problem found, as one clear message each; [] when the repository is sound."""
    repo = Path(repo)
    if not repo.is_dir():
        return [f"{repo}: not a directory"]
    errors: list[str] = []
    configs = {}
    for folder in sorted(p for p in repo.iterdir() if p.is_dir()):
        path = folder / CONFIG_FILE
        if not path.is_file():
            errors.append(f"{folder.name}: no {CONFIG_FILE}")
            continue
        try:
            cfg = parse_config(path)
        except ConfigError as e:
            errors.append(str(e))
            continue
        if cfg.name and cfg.name != folder.name:
            errors.append(f"{folder.name}: config name {cfg.name!r} differs from its folder name")
        configs[folder.name] = cfg
    for name, cfg in configs.items():
        if not (cfg.platform or cfg.backend):
            errors.append(f"{name}: neither platform nor backend is set")
        if cfg.platform == "ensemble":
            errors += _check_ensemble(name, cfg, configs)
            if not (repo / name / "1").is_dir():
                errors.append(f"{name}: missing version folder {name}/1 (an ensemble needs an empty one)")
            continue
        versions = [p for p in (repo / name).iterdir() if p.is_dir() and p.name.isdigit()]
        if not versions:
            errors.append(f"{name}: missing version folder (expected {name}/1/)")
        wanted = _model_file(cfg)
        for v in versions:
            if wanted and not (v / wanted).exists():
                errors.append(f"{name}: version {v.name} has no {wanted}")
        if not cfg.input or not cfg.output:
            errors.append(f"{name}: a model needs inputs and outputs")
    return errors


def check_repository(repo: str | Path) -> None:
    errors = validate_repository(repo)
    if errors:
        raise ConfigError(f"invalid Triton model repository {repo}:\n  " + "\n  ".join(errors))
