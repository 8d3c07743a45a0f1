"""Checkpoints -> parameter pytrees (HF safetensors directories; packaged GGUF defaults)."""
