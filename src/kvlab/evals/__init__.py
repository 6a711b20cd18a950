"""Quality under a KV setting: perplexity and passkey retrieval computed through the lab's caches.

Depends on nn, cache and checkpoints only; `kvlab eval` (commands/eval_cmd.py) and the
real-models report drive it.
"""
