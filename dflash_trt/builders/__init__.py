"""Engines from exported graphs and checkpoints: TensorRT drafter plans, TensorRT-LLM targets, `make engines`."""
