"""Training: the DFlash drafter (the paper's recipe) and small causal LMs for the demo."""
