"""Exact KV-cache, weight, seats and latency arithmetic. Pure Python: stdlib only."""
