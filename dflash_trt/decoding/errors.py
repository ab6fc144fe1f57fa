"""The errors a request's input raises (below `request` and `grammar`, which both raise them)."""

from __future__ import annotations


class InputError(ValueError):
    """A request the engines cannot serve as given (bad ids, lengths, settings)."""


class ContextLengthError(InputError):
    def __init__(self, message: str, prompt_alone: bool = False):
        super().__init__(message)
        self.prompt_alone = prompt_alone  # the prompt leaves no room for even one new token
