"""Attention kernels shared by models and parallel layers (no model imports here)."""
