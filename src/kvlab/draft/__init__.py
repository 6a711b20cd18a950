"""A small draft model for speculative decoding, distilled from the target on the target's own text.

prompts (chat questions, predictable text) -> corpus (the target's answers with its top
log-probabilities, generated once through the engine and cached) -> model (the draft's shapes,
its embeddings initialised from the target's) -> distill (the loss, on the resumable trainer)
-> a model directory that `--speculative-config '{"method": "draft_model", "model": DIR}'` loads.
"""
