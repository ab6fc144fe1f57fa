"""What a plan is made of: the drafter's acceptance and the passes' costs, each saying whether it was measured.

Acceptance (`Acceptance`): per-position rates (`sim.acceptance.AcceptanceProfile`), from
  * a trace file (`read_trace`): the rounds one or more `dflash-trt generate --json --trace` runs printed (one
    object a round, {"block_size": B, "drafted": [...], "accepted": n}), or the server's per-request
    speculative-decoding statistics at level "detailed" (per_step_drafted / per_step_accepted). Every round is
    pooled into one profile: position k's rate is the share of rounds that reached it and passed it, so the
    profile's tau at every block the rounds drafted is exactly the trace's mean (`AcceptanceProfile.from_rounds`);
  * a named profile (`named_acceptance`): "demo", the demo pair's acceptance that `make bench-load` measured per
    prompt (data/measured/demo-load.json: the code prompts' tau at block 8, each prompt a constant rate), or the
    simulator's profiles fitted to the paper's published tau ("paper", "mixed" or one benchmark, block 16).

Cost (`Cost`): a `sim.cost.PassCost`, from
  * Vidur's GPU op profiles (`vidur_cost`): measured per op on the GPU for a profiled model shape; the target's
    own shape, when given, picks the nearest profiled one (an assumption the plan states);
  * a grid measured on the user's GPU by scripts/gpu_bare.py (`grid_cost`): target and drafter pass seconds by
    rows x tokens per row at a context length, fitted as the trtllm-serve-config command fits them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..sim.acceptance import AcceptanceProfile
from ..sim.cost import LinearPassCost, PassCost, ProfileCost
from ..sim.measured import DEMO_LOAD, read

if TYPE_CHECKING:
    from ..decoding.cost import EngineCost
    from .metrics import Observed

MAX_POSITIONS = 15  # the simulated drafter's positions (sim_engines' block 16): profiles are padded to them
DEMO_BLOCK = 8  # the demo drafter's trained block (models/drafter/config.json), at which bench-load measured tau


class PlanInputError(ValueError):
    """An input the plan cannot use (the message says which file or name, and why)."""


@dataclass(frozen=True)
class Acceptance:
    name: str
    profiles: tuple[AcceptanceProfile, ...]  # one per request class, equal weights
    block_size: int  # the largest block the drafter drafts (its trained block)
    source: str  # where the rates come from, in words
    measured: bool


@dataclass
class Cost:
    cost: PassCost
    source: str
    measured: bool  # every part measured
    parts: dict[str, str] = field(default_factory=dict)  # operators / shape / drafter: measured, assumed or modelled


def padded(profile: AcceptanceProfile) -> AcceptanceProfile:
    """The profile with MAX_POSITIONS rates (the simulated drafter asks for them all; a plan never drafts past
    the drafter's block, so the padding's value never decides anything)."""
    rates = profile.rates[:MAX_POSITIONS] or (0.0,)
    return AcceptanceProfile(profile.name, rates + (rates[-1],) * (MAX_POSITIONS - len(rates)))


# ---- acceptance from a trace --------------------------------------------------------------------------------
def _records(path: Path) -> list[Any]:
    """The JSON values in a file: one JSON document (a list is its items) or JSON lines."""
    try:
        text = path.read_text()
    except OSError as e:
        raise PlanInputError(f"cannot read the trace {path}: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
        return doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        pass
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise PlanInputError(f"{path} line {i} is not JSON ({e.msg}): expected JSON or JSON lines") from None
    return out


def _round(obj: Any, where: str) -> tuple[int, int]:
    """(block, accepted drafts) of one trace round."""
    block, accepted, drafted = obj.get("block_size"), obj.get("accepted"), obj.get("drafted")
    if not isinstance(block, int) or not isinstance(accepted, int) or block < 1:
        raise PlanInputError(f"{where}: a round needs an integer block_size >= 1 and accepted, got {obj}")
    if isinstance(drafted, list) and len(drafted) != block - 1:  # a block holds the anchor and its drafts
        raise PlanInputError(f"{where}: block_size {block} with {len(drafted)} drafted ids (expected {block - 1})")
    if not 0 <= accepted <= block - 1:
        raise PlanInputError(f"{where}: accepted {accepted} outside 0..{block - 1} (the round's drafts)")
    return block, accepted


def _stats_rounds(stats: dict[str, Any], where: str) -> list[tuple[int, int]]:
    drafted, accepted = stats.get("per_step_drafted"), stats.get("per_step_accepted")
    if not isinstance(drafted, list) or not isinstance(accepted, list) or len(drafted) != len(accepted):
        raise PlanInputError(
            f"{where}: the server's statistics need per_step_drafted and per_step_accepted (ask for them with "
            '"spec_decode_metrics": "detailed"); a summary has no per-position acceptance'
        )
    return [_round({"block_size": int(d) + 1, "accepted": a}, where) for d, a in zip(drafted, accepted)]


def _rounds_of(obj: Any, where: str) -> Iterator[tuple[int, int]]:
    """The rounds one JSON value holds: a round, a generate output with "trace", or server statistics."""
    if not isinstance(obj, dict):
        raise PlanInputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "block_size" in obj and "accepted" in obj:
        yield _round(obj, where)
    elif isinstance(obj.get("trace"), list):
        for r in obj["trace"]:
            yield _round(r if isinstance(r, dict) else {}, where)
    elif isinstance(obj.get("metrics"), dict) or "speculative_decoding" in obj or "per_step_drafted" in obj:
        stats = (obj.get("metrics") or obj).get("speculative_decoding", obj)
        yield from _stats_rounds(stats if isinstance(stats, dict) else {}, where)
    else:
        raise PlanInputError(
            f"{where}: neither a trace round ({{block_size, drafted, accepted}}), nor `generate --json --trace` "
            'output (a "trace" list), nor the server\'s speculative-decoding statistics'
        )


def read_trace(path: str | Path, block_size: int | None = None) -> Acceptance:
    """Pooled per-position acceptance of every round in `path` (module docstring). `block_size`: the drafter's
    trained block (default: the largest block the trace drafted)."""
    path = Path(path)
    rounds = [r for i, obj in enumerate(_records(path), 1) for r in _rounds_of(obj, f"{path} item {i}")]
    drafted = [(b, a) for b, a in rounds if b >= 2]
    if not drafted:
        raise PlanInputError(f"{path} holds no round that drafted (block_size >= 2): nothing to measure acceptance on")
    block = block_size or max(b for b, _ in drafted)
    profile = AcceptanceProfile.from_rounds(path.stem, drafted)
    source = (
        f"measured: {len(drafted)} drafted rounds in {path} (blocks {min(b for b, _ in drafted)}.."
        f"{max(b for b, _ in drafted)}), pooled per position"
    )
    return Acceptance(path.stem, (padded(profile),), block, source, True)


# ---- named acceptance ---------------------------------------------------------------------------------------
def named_acceptance(name: str) -> Acceptance:
    """ "demo" (measured on the demo pair) or a simulator workload's profiles (fitted to published tau)."""
    if name == "demo":
        return demo_acceptance()
    from ..sim.serving import workload

    try:
        work = workload(name)
    except ValueError as e:
        raise PlanInputError(f"unknown acceptance profile {name!r}: demo, paper, mixed or a benchmark ({e})") from None
    source = (
        "assumed: Qwen3-8B DFlash's published tau at 15 drafts (block 16; the paper's Table 1, T=0), per-position shape "
        "assumed (dflash_trt/sim/acceptance.py)"
    )
    return Acceptance(name, tuple(padded(p) for p in work.profiles), 16, source, False)


def demo_acceptance(path: Path = DEMO_LOAD) -> Acceptance:
    try:
        per_prompt = read(path, "demo-load")["in_process"]["per_prompt"]
        code = [p for p in per_prompt if p["set"] == "code"]
        profiles = tuple(
            padded(AcceptanceProfile.from_tau(f"prompt{p['prompt']}", p["tau_single_b8"], DEMO_BLOCK)) for p in code
        )
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise PlanInputError(
            f"the demo pair's measured acceptance ({path}) is unreadable: {e!r}; run `make bench-load`"
        ) from None
    if not profiles:
        raise PlanInputError(f"{path} holds no code prompt's acceptance; run `make bench-load`")
    source = (
        f"measured: the demo pair's tau at 7 drafts (block 8) on {len(profiles)} code prompts (make bench-load, {path.name}), "
        "each prompt a constant per-position rate"
    )
    return Acceptance("demo", profiles, DEMO_BLOCK, source, True)


# ---- cost ---------------------------------------------------------------------------------------------------
def _params(layers: int, hidden: int, intermediate: int) -> float:
    return layers * (4 * hidden * hidden + 3 * hidden * intermediate)


def profiled_models(gpu: str) -> list[str]:
    """The models (sim.profiles.MODELS) with an op profile on `gpu` (data/profiles/vidur/GPU/)."""
    from ..sim.profiles import MODELS, PROFILE_DIR

    return [m for m, shape in MODELS.items() if (PROFILE_DIR / gpu / f"{shape.name}.mlp.csv").is_file()]


def nearest_model(config: dict[str, Any], models: Sequence[str]) -> str:
    """The model of `models` whose layer weights are nearest the target's in log ratio."""
    import math

    from ..sim.profiles import MODELS

    try:
        own = _params(int(config["num_hidden_layers"]), int(config["hidden_size"]), int(config["intermediate_size"]))
    except (KeyError, TypeError, ValueError) as e:
        raise PlanInputError(f"the target config lacks a shape field ({e})") from None
    return min(
        models, key=lambda m: abs(math.log(_params(MODELS[m].layers, MODELS[m].hidden, MODELS[m].intermediate) / own))
    )


def vidur_cost(gpu: str, model: str | None, tp: int, target_config: dict[str, Any] | None = None) -> Cost:
    """Vidur's profile of `model` (or of the profiled shape nearest `target_config`) on `gpu` at `tp`."""
    from ..sim.profiles import GPUS, MODELS

    if gpu not in GPUS:
        raise PlanInputError(f"no Vidur profile for GPU {gpu!r}: one of {sorted(GPUS)}")
    note = ""
    models = profiled_models(gpu)
    if model is None:
        if not models:
            raise PlanInputError(f"no model profiled on {gpu}")
        model = nearest_model(target_config, models) if target_config is not None else models[0]
        note = "; assumed: the profiled shape nearest the target" if target_config is not None else ""
    if model not in models:
        raise PlanInputError(f"no Vidur profile for model {model!r} on {gpu}: one of {models}")
    try:
        cost = ProfileCost(gpu, model, tp)
    except (ValueError, KeyError, OSError) as e:
        raise PlanInputError(f"the {gpu} {model} profile cannot price tp {tp}: {e}") from None
    source = (
        f"Vidur: {GPUS[gpu].name} op profiles of {MODELS[model].name} at tp {tp}{note}; attention and "
        "the drafter's shape modelled (dflash_trt/sim/cost.py)"
    )
    parts = {
        "operators": f"measured: Vidur's {GPUS[gpu].name} op profiles at tp {tp}",
        "shape": f"assumed: {MODELS[model].name}, the profiled shape nearest the target"
        if note
        else f"given: {MODELS[model].name} (--model or the first profiled)",
        "drafter": "modelled: the DFlash drafter's passes priced from the target's profiled ops (sim/cost.py)",
    }
    return Cost(cost, source, False, parts)


@dataclass
class ServerPassCost:
    """A CPU server's own linear pass costs (`sim.cost.LinearPassCost`: what its start-up grid fitted), priced
    within that server's step budget (`step_tokens`, read by tune.run) rather than a GPU's."""

    linear: LinearPassCost
    step_tokens: int

    def target(self, new: Sequence[int], past: Sequence[int], logits: int) -> float:
        return self.linear.target(new, past, logits)

    def drafter(self, blocks: Sequence[int], new_context: Sequence[int], past: Sequence[int]) -> float:
        return self.linear.drafter(blocks, new_context, past)


def cost_model(path: str | Path, step_tokens: int | None = None) -> Cost:
    """A recorded CPU cost model: {"target": {fixed, per_row, per_token[, one_token]}, "drafter": {...}}, or a
    `make bench-load` results.json holding one under in_process.cost_model (what the server's adaptive policy
    measures at start-up, `decoding.cost.measure_costs`). Priced within the CPU server's step budget."""
    from ..decoding.chunking import STEP_TOKENS

    path = Path(path)
    try:
        doc = json.loads(path.read_text())
        doc = doc.get("in_process", {}).get("cost_model", doc)
        linear = LinearPassCost.from_cost_model(doc)
    except OSError as e:
        raise PlanInputError(f"cannot read the cost model {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise PlanInputError(
            f'{path}: not a cost model ({{"target": {{fixed, per_row, per_token}}, "drafter": ...}}): {e!r}'
        ) from None
    budget = step_tokens or STEP_TOKENS
    source = f"measured: the CPU cost model in {path} (linear fits of a start-up grid), steps of {budget} tokens"
    parts = {
        "operators": f"measured: whole passes of the pair on the machine that wrote {path.name}",
        "shape": "measured: the pair itself",
        "drafter": "measured: its passes in the same grid",
    }
    return Cost(ServerPassCost(linear, budget), source, True, parts)


@dataclass
class GridPassCost:
    """Pass times from a measured grid's fits: target (rows, new tokens), drafter (rows, block tokens). The
    context each pass sees is the grid's one context length, the drafter's new context is not priced, and
    prefills are priced by the fit beyond its largest measured pass (all three assumed)."""

    target_fit: EngineCost
    drafter_fit: EngineCost

    def target(self, new: Sequence[int], past: Sequence[int], logits: int) -> float:
        return float(self.target_fit(len(new), sum(new))) if new else 0.0

    def drafter(self, blocks: Sequence[int], new_context: Sequence[int], past: Sequence[int]) -> float:
        return float(self.drafter_fit(len(blocks), sum(blocks))) if blocks else 0.0


def grid_cost(
    path: str | Path, context: int | None = None, target_config: dict[str, Any] | None = None, tp: int = 1
) -> Cost:
    """A scripts/gpu_bare.py cost grid; checked against the target's shape and tp when `target_config` is given."""
    from ..builders.trtllm_serve import ServeConfigError, read_cost_table
    from ..costgrid import CostGridMismatch, check_grid_matches

    path = Path(path)
    try:
        raw = json.loads(path.read_text())
        target, drafter, chosen = read_cost_table(path, context)
        if target_config is not None:
            check_grid_matches(raw, target_config, tp, source=f"cost grid {path}")
    except OSError as e:
        raise PlanInputError(f"cannot read the cost grid {path}: {e.strerror or e}") from None
    except (ServeConfigError, CostGridMismatch, ValueError) as e:
        raise PlanInputError(str(e)) from None
    ident = raw.get("identity") if isinstance(raw, dict) else None
    on = f" on {ident.get('gpu')} ({ident.get('engine')}, tp {ident.get('tp')})" if isinstance(ident, dict) else ""
    source = f"measured: cost grid {path}{on}, context {chosen}; prefill beyond the grid extrapolated (assumed)"
    parts = {
        "operators": f"measured: cost grid {path}{on}",
        "shape": "measured: the grid's target shape" + (" (checked against --target)" if target_config else ""),
        "drafter": "measured: the grid's drafter passes; prefill beyond the grid extrapolated (assumed)",
    }
    return Cost(GridPassCost(target, drafter), source, True, parts)


def served_step_cost(cost: Cost, scrape: str | Path) -> Cost:
    """A CPU server's cost model (`cost_model`) scaled to the steps a `plan check --save` scrape of that server saw:
    k = the mean served step's wall seconds / the cost model's seconds for that step's passes (`Observed.steps`).

    The start-up grid times the passes alone; a served step also holds the loop's own work per step, the HTTP
    and streaming threads and, on a shared machine, the load client, none of which the grid sees. k prices them
    as a share of the passes (one number: the scrape has one mean step), so a plan made from the scrape predicts
    the tokens/s of the server that ran, not of its engines alone. The scrape's other figures (acceptance) are
    read by `metrics_acceptance`."""
    if not isinstance(cost.cost, ServerPassCost):
        raise PlanInputError("the served steps of a scrape scale a CPU server's --cost-model only")
    path = Path(scrape)
    obs = read_scrape(path)
    m, lin = obs.steps, cost.cost.linear
    if obs.engine != "dflash-trt" or not m:  # another engine's scrape, or one saved before the steps were read
        return cost
    target = lin.target_fixed + lin.target_per_row * (m["rows"] + m["chunk_rows"])
    target += lin.target_per_token * (m["tokens"] + m["chunk_tokens"])
    drafting = min(1.0, m["drafting_rows"])  # the drafter runs on the steps where a row drafts: about this share
    drafter = drafting * lin.drafter_fixed + lin.drafter_per_row * m["drafting_rows"]
    drafter += lin.drafter_per_token * (m["drafted_tokens"] + 2 * m["drafting_rows"])  # + anchor and new context
    k = m["wall_s"] / (target + drafter)
    scaled = replace(lin, **{f.name: k * getattr(lin, f.name) for f in fields(lin) if getattr(lin, f.name) is not None})
    source = (
        f"{cost.source}; scaled x{k:.2f} to the served steps of {path} ({m['wall_s'] * 1e3:.1f} ms a step of "
        f"{m['rows']:.1f} rows against {(target + drafter) * 1e3:.1f} ms of passes)"
    )
    parts = {**cost.parts, "served": f"measured: x{k:.2f}, the server's wall time per step over its passes'"}
    return Cost(ServerPassCost(scaled, cost.cost.step_tokens), source, cost.measured, parts)


# ---- acceptance from an engine's metrics --------------------------------------------------------------------
def read_scrape(path: Path) -> Observed:
    """A `plan check --save` file (PlanInputError, saying why, where it is not one)."""
    from .metrics import MetricsError, Observed

    try:
        return Observed.from_json(json.loads(path.read_text()))
    except OSError as e:
        raise PlanInputError(f"cannot read the scrape {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, MetricsError, AttributeError) as e:
        raise PlanInputError(f"{path} is not a `dflash-trt plan check --save` file: {e}") from None


def metrics_acceptance(path: str | Path, block_size: int | None = None) -> Acceptance:
    """The acceptance a `plan check --save FILE` scrape saw: its per-position rates where the engine gives them
    (the last one carried past the observed positions), else a constant rate with its tau at the drafts per
    round the engine ran (the shape assumed, and the source says so)."""
    path = Path(path)
    obs = read_scrape(path)
    drafts = round(obs.mean_drafts) if obs.mean_drafts else None
    block = block_size or (drafts + 1 if drafts else None)
    if block is None or block < 2:
        raise PlanInputError(f"{path}: the engine's drafts per round are unknown; give --block-size")
    what = f"{obs.engine} /metrics at {obs.url} over {obs.seconds:.0f} s, mean batch {obs.mean_batch:.1f}"
    if obs.position_rates:
        profile = AcceptanceProfile(path.stem, tuple(obs.position_rates))
        source = f"measured: per-position acceptance from {what}"
    else:
        at = drafts + 1 if drafts else block
        profile = AcceptanceProfile.from_tau(path.stem, min(max(obs.tau, 1.0), float(at)), at)
        source = f"measured: tau {obs.tau:.2f} at {drafts} drafts from {what}; per-position shape assumed (constant)"
    return Acceptance(path.stem, (padded(profile),), block, source, True)
