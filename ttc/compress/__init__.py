"""Compression before export: pruning and quantization-aware training."""
