"""Parallel layouts beyond data parallelism: dp x tp x sp groups (dims), tensor and sequence parallel layers."""
