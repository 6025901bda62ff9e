"""Quantized checkpoints: their `quantization_config` (config.py) and their tensors' packings (int4_formats.py)."""
