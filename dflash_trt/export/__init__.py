"""Checkpoint -> portable graph: the DFlash drafter (with the target's embedding and lm_head) to ONNX."""
