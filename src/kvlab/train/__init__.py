"""Training: character data (fetch, verify, split, deterministic batches) and a resumable loop.

May import kvlab.nn and kvlab.plan, nothing higher.
"""
