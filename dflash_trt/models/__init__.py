"""PyTorch model definitions and checkpoint I/O (drafter, Hugging Face target)."""
