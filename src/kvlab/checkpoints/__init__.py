"""Checkpoints in and out of kvlab.nn: GGUF and Hugging Face readers/writers, name resolution,
KV-head conversion. May import kvlab.nn (and what it may import), nothing higher."""
