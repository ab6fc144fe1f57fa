"""Running requests to the end over a batch's `step()` (`RunsToEnd`, a base of `loop.BatchDecoder`): the CLI's,
the benchmarks' and a stream's way through the loop, which needs of the batch only its membership and its step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .request import GenerationConfig, GenerationResult, Round
from .row import BatchRow
from .step import StepResult

__all__ = ["RunsToEnd"]


class RunsToEnd:
    """`run`, `generate` and `stream` over the subclass's `add`, `cancel`, `active` and `step`."""

    @property
    def active(self) -> list[BatchRow]:
        raise NotImplementedError

    def add(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> BatchRow:
        raise NotImplementedError

    def cancel(self, row: BatchRow) -> None:
        raise NotImplementedError

    def step(self) -> StepResult:
        raise NotImplementedError

    def run(self) -> None:
        while self.active:
            self.step()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        configs: Sequence[GenerationConfig] | GenerationConfig = GenerationConfig(),
    ) -> list[GenerationResult]:
        """Every prompt as one row of the same batch, run to the end. A row's engine error (a drafter that
        raised without `drafter_fallback`) is raised here once all rows are done, as `stream` raises it."""
        if isinstance(configs, GenerationConfig):
            configs = [configs] * len(prompts)
        rows = [self.add(p, c) for p, c in zip(prompts, configs)]
        self.run()
        for r in rows:
            if r.error is not None:
                raise r.error
        return [r.result() for r in rows]

    def stream(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> Iterator[Round]:
        """One request's rounds as they are committed (the prefill's first token, then one per step); the row is
        cancelled if the caller stops early. Steps the whole batch: use it on a decoder of its own."""
        row = self.add(prompt_ids, config)
        try:
            while not row.done:
                for r, committed in self.step():
                    if r is row:
                        yield committed
            if row.error is not None:
                raise row.error
        finally:
            if not row.done:
                self.cancel(row)
