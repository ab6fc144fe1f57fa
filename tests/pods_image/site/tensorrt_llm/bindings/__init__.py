"""STAND-IN for tensorrt_llm.bindings (see executor.py)."""
