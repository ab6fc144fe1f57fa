"""The PyTorch target for families the layered engine (`torch_backend.TorchTargetSession`) cannot express: one
Hugging Face forward per row, on that row's own transformers cache, with exact per-row rollback.

Which families: `layered_refusal` says why a config cannot run layer by layer on the slot cache (its layers
are not all full attention over one K/V per layer: Gated DeltaNet linear attention (Qwen3.5), sliding windows
and attention sinks (gpt-oss), per-layer inputs and shared K/V (Gemma 4), or a sliding window anywhere).
Those rows run here, one forward per row and pass (`rows.PerRowTarget`): correct, not batched.

Rollback. A verify pass appends a block of B tokens and the loop then keeps a prefix of it; each row must be
left exactly where the target alone would be after the prefix. Full-attention and sliding-window K/V are
cut by length. A linear-attention layer instead folds every token into a fixed-size recurrent state and a
convolution window, which cannot be cut; so each pass records them: transformers' `activate_past_recording`
keeps the convolution inputs of the pass and the recurrent state after each of its last `keep` tokens
(computed token by token, `recurrent_states_to_keep`), and `crop` restores the state after the accepted
prefix. Chosen over re-running the accepted tokens because it costs no second pass and the restored state
is the one the pass itself computed. A pass keeps a state per token (keep = its token count) when it may
be rolled back: every pass but a prefill (`last_logits_only`, which the loop never rolls back; keeping a
state per prompt token would run the prompt token by token). Only the last pass can be rolled back, which
is all the decoding loop and the cost model ask (they roll back right after the pass); deeper is refused.

What the installed transformers can do decides the linear-attention rollback (`linear_rollback`):
- "recorded": per-token recurrent states (`activate_past_recording(recurrent_states_to_keep=...)`, first in
  transformers 5.25.0, the answer to transformers issue 49036), as above;
- "replay": earlier 5.x releases take no budget and their `crop` cuts only the convolution inputs, leaving the
  recurrent state after the whole block (issue 49036: silently wrong). There each undoable pass first copies
  its linear-attention layers (a fixed-size state, whatever the context); a rollback puts the copies back,
  cuts the other layers by the whole pass and runs the kept tokens again: one more forward per partly
  accepted round, and nothing transformers lacks.
Sliding-window layers are cut by `crop` in both modes: with past recording on, a pass keeps the tokens that
fell out of the window until the crop, so a rollback brings them back (every transformers 5.x).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch

from ..models.target import extract_features
from .base import TargetOutput
from .rows import PerRowTarget

# what the layered engine runs: q/k/v/o attention over one K/V per layer (optional q/k norms), any MLP module
LAYERED_FAMILIES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe")


def layered_refusal(text_config: Any) -> str | None:
    """Why the layered slot-cache engine cannot run this target (None: it can)."""
    family = str(text_config.model_type)
    if family not in LAYERED_FAMILIES:
        return f"{family} layers are not plain full attention"
    layer_types = getattr(text_config, "layer_types", None) or []
    window = getattr(text_config, "sliding_window", None)
    if any(t != "full_attention" for t in layer_types) or (
        getattr(text_config, "use_sliding_window", True)
        and window is not None
        and window < int(getattr(text_config, "max_position_embeddings", 1 << 30))
    ):
        return "it uses a sliding window"
    return None


def _holds_linear_state(layer: Any) -> bool:
    """A linear-attention cache layer (convolution inputs and a recurrent state that `crop` cannot cut)."""
    return hasattr(layer, "conv_states") or hasattr(layer, "recurrent_states")


def _takes_budget(layer: Any) -> bool:
    return "recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters


def linear_rollback(cache: Any) -> str:
    """How a pass over a hybrid cache is undone on the installed transformers: "recorded" where its linear
    layers keep the recurrent state after each token (5.25.0 on), else "replay" (see the module doc)."""
    layers = [layer for layer in cache.layers if _holds_linear_state(layer)]
    if layers and all(hasattr(layer, "activate_past_recording") and _takes_budget(layer) for layer in layers):
        return "recorded"
    return "replay"


class HfRowSequence:
    """One row: the Hugging Face forward on the row's own cache (a `rows.SequenceTarget`)."""

    def __init__(self, model: Any, feature_layer_ids: tuple[int, ...]):
        from transformers import DynamicCache

        self.model, self.feature_layer_ids = model, feature_layer_ids
        cache: Any = DynamicCache(config=model.config)
        # transformers 4.57 has no past recording (nor these families' linear-attention layers), and there
        # crop(0) means "keep 0 tokens": only a negative crop is called then
        self.records = hasattr(cache, "activate_past_recording")
        self.linear_layers = [i for i, layer in enumerate(cache.layers) if _holds_linear_state(layer)]
        self.mode = linear_rollback(cache) if self.linear_layers else "none"
        if self.records:
            for layer in cache.layers:
                if not hasattr(layer, "activate_past_recording"):
                    continue
                # budget 0 until a pass sets its own (`_keep`); without an explicit budget 5.25 fails, and
                # releases before it take no argument at all
                if _takes_budget(layer):
                    layer.activate_past_recording(recurrent_states_to_keep=0)
                else:
                    layer.activate_past_recording()
        self.cache = cache
        params = inspect.signature(model.forward).parameters  # transformers 5.x renamed past_key_values
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._length = 0
        self._undoable = 0  # tokens of the last pass that rollback may drop
        self._pending_trim = False  # the last pass's recordings not yet cut back by a crop
        self._saved: dict[int, Any] = {}  # "replay": the linear-attention layers before the last pass
        self._pass_ids: torch.Tensor | None = None  # "replay": the last pass's tokens, to run the kept ones again

    @property
    def length(self) -> int:
        return self._length

    def _keep(self, count: int) -> None:
        if self.mode != "recorded":
            return
        for layer in self.cache.layers:
            if getattr(layer, "record_past", False) and hasattr(layer, "recurrent_states_to_keep"):
                layer.recurrent_states_to_keep = count

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, *, last_logits_only: bool = False, features: bool = True
    ) -> TargetOutput:
        if self._pending_trim and self.records:  # a pass not rolled back: drop its recordings (crop(0) keeps all)
            self.cache.crop(0)
        n = int(token_ids.numel())
        undoable = 0 if last_logits_only else n
        self._keep(undoable)
        if self.mode == "replay":
            self._saved = {i: copy.deepcopy(self.cache.layers[i]) for i in self.linear_layers} if undoable else {}
            self._pass_ids = token_ids.detach().view(-1).clone() if undoable else None
        out = self._run(token_ids, last_logits_only, features and bool(self.feature_layer_ids))
        self._undoable, self._pending_trim = undoable, True
        return out

    def _run(self, token_ids: torch.Tensor, last_logits_only: bool, want: bool) -> TargetOutput:
        """One Hugging Face forward of `token_ids` after the row's tokens (positions follow on)."""
        n = int(token_ids.numel())
        device = next(self.model.parameters()).device
        ids = token_ids.to(device).view(1, -1)
        out = self.model(
            input_ids=ids,
            position_ids=torch.arange(self._length, self._length + n, device=device)[None],
            use_cache=True,
            logits_to_keep=1 if last_logits_only else 0,
            output_hidden_states=want,
            **{self.cache_kwarg: self.cache},
        )
        self._length += n
        feats = extract_features(out.hidden_states, self.feature_layer_ids)[0] if want else None
        return TargetOutput(logits=out.logits[0].float(), features=feats)

    @torch.inference_mode()  # the replay's copies and forward are inference tensors, as the pass's are
    def rollback(self, length: int) -> None:
        drop = self._length - length
        if not 0 <= drop <= self._undoable:
            raise ValueError(
                f"cannot roll back to {length}: the row holds {self._length} tokens and only the last pass's "
                f"{self._undoable} can be undone"
            )
        if drop and self.mode == "replay":
            self._replay(length)
        elif drop or self.records:  # crop(0) trims the recordings (see __init__ for 4.57)
            self.cache.crop(-drop)
        self._length, self._undoable, self._pending_trim = length, 0, False

    def _replay(self, length: int) -> None:
        """Back to before the last pass (the saved linear-attention layers, every other layer cut by the whole
        pass), then the pass's first kept tokens again: the state a pass over only those tokens leaves."""
        assert self._pass_ids is not None
        n = int(self._pass_ids.numel())
        for i, layer in enumerate(self.cache.layers):
            if i in self._saved:
                self.cache.layers[i] = self._saved[i]
            else:
                layer.crop(-n)
        self._length -= n
        kept = self._pass_ids[: length - self._length]
        self._saved, self._pass_ids = {}, None
        if kept.numel():
            self._run(kept, last_logits_only=True, want=False)
            self.cache.crop(0)  # trim what the replay recorded

    def close(self) -> None:
        self.cache = None


class HfRowsSession(PerRowTarget):
    """A target session of `HfRowSequence` rows (one forward per row and pass)."""

    def __init__(self, model: Any, feature_layer_ids: tuple[int, ...]):
        super().__init__(lambda: HfRowSequence(model, feature_layer_ids))
