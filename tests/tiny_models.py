"""The tiny-model factory under its old test-side name (the tests import it as `tiny_models`)."""

from dflash_trt.models.tiny import (  # noqa: F401
    make_tiny_drafter,
    make_tiny_target,
    tiny_drafter_config,
    tiny_target_config,
)
