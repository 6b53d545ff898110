"""Optimizers that run beside the DeepSpeed engine (for parameters the engine does not own)."""
