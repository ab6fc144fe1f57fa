"""Engines behind one small interface: PyTorch, ONNX Runtime, TensorRT, TensorRT-LLM."""
