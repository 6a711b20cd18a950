"""Structured outputs: a grammar (JSON schema, JSON object, regex, choice, Lark/GBNF) each token must follow.

vLLM's request form (`StructuredOutputsParams`, and `response_format`), on llguidance, one of
vLLM's two backends. Measured on SmolLM2's 49,152-token vocabulary (`python -m
kvlab.bench.structured --parts backends`, reports/serving/structured.json, AMD EPYC, AVX2), for
16 requests under one JSON schema llguidance compiled in 12.5 ms against xgrammar's 793 ms and
filled the 16 masks in 1.09 ms a step against 5.55 ms; applying them (below) took 0.17 ms
against xgrammar's own CPU helper's 13.8 ms. So kvlab uses llguidance.

Each constrained request gets a matcher (an Earley parser over the grammar, walking the
tokenizer's trie lazily). Before every sampling step the matcher catches up on the tokens the
request has emitted since (so preemption and recompute need nothing special), fills its row of
a bitmask, and the sampler's logits for that row are masked: constrained and free requests are
sampled in the same step from the same logits tensor. When the grammar is complete only EOS is
allowed, so the request stops there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Optional, Union

import torch

from kvlab.engine.errors import RequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one of json / regex / choice / grammar / json_object."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise RequestError("structured outputs take exactly one of json, regex, choice, grammar or json_object, "
                               f"got {', '.join(given) or 'none'}", "structured_outputs")
        if self.structural_tag is not None:
            raise RequestError("structured_outputs.structural_tag is not supported by kvlab (SmolLM2 has no "
                               "tool-call tags); use json, regex, choice or grammar", "structured_outputs")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise RequestError("structured_outputs.choice must be a non-empty list of non-empty strings",
                               "structured_outputs")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise RequestError("structured_outputs.json must be a JSON schema (an object or its text)",
                               "structured_outputs")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(f"structured_outputs.{name} must be a non-empty string", "structured_outputs")

    @classmethod
    def from_dict(cls, values: dict) -> "StructuredOutputsParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise RequestError(f"structured_outputs has no field {unknown[0]!r} (fields: {', '.join(sorted(known))})",
                               "structured_outputs")
        return cls(**values)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    def grammar_text(self) -> str:
        """The llguidance grammar for this constraint (vLLM's guidance backend's translation)."""
        import llguidance

        json_options = {"whitespace_flexible": not self.disable_any_whitespace}
        if self.whitespace_pattern is not None:
            json_options["whitespace_pattern"] = self.whitespace_pattern
        try:
            if self.json is not None:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema is an object")
                if self.disable_additional_properties:
                    schema = _closed(schema)
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_options)
            if self.json_object:
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=json_options)
            if self.json_object is not None:
                raise ValueError("json_object must be true when given")
            if self.regex is not None:
                return llguidance.grammar_from("regex", self.regex)
            if self.choice is not None:
                return llguidance.grammar_from("choice", json.dumps(self.choice))
            return llguidance.grammar_from("grammar", self.grammar)
        except (ValueError, TypeError, RuntimeError) as error:
            raise RequestError(f"structured_outputs.{self.kind} is not a valid constraint: {error}",
                               "structured_outputs") from None


def _closed(schema):
    """`disable_additional_properties`: every object schema without an explicit rule gets additionalProperties false."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def require_llguidance() -> None:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        raise RequestError("structured outputs need llguidance: pip install 'kvlab[serve]' (or llguidance)",
                           "structured_outputs") from None


class Grammars:
    """The engine's grammar side: one llguidance tokenizer (built on first use, ~0.4 s for SmolLM2) and a
    matcher per constrained request."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll = None
        self._compiled: dict[str, str] = {}  # constraint text -> grammar (many requests share one schema)

    @property
    def ll_tokenizer(self):
        if self._ll is None:
            import llguidance

            if self.tokenizer is None:
                raise RequestError("structured outputs need the model's tokenizer", "structured_outputs")
            self._ll = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                              eos_token=self.tokenizer.eos_id)
        return self._ll

    def grammar(self, params: StructuredOutputsParams) -> str:
        """The validated grammar for `params` (compiled once per distinct constraint); RequestError (HTTP 400)
        when it is invalid."""
        import llguidance

        key = json.dumps({f.name: getattr(params, f.name) for f in fields(params)}, sort_keys=True, default=str)
        grammar = self._compiled.get(key)
        if grammar is None:
            grammar = params.grammar_text()
            error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
            if error:
                raise RequestError(f"structured_outputs.{params.kind} is not a valid constraint: {error}",
                                   "structured_outputs")
            if len(self._compiled) > 256:  # bounded: a long-running server sees endless distinct schemas
                self._compiled.clear()
            self._compiled[key] = grammar
        return grammar

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for `params`; RequestError (HTTP 400) when the grammar is invalid."""
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.grammar(params), log_level=0)
        if matcher.is_error():
            raise RequestError(f"structured_outputs.{params.kind} is not a valid constraint: {matcher.get_error()}",
                               "structured_outputs")
        return matcher


class Tracked:
    """One constrained request's matcher and how many of its output tokens it has consumed."""

    __slots__ = ("matcher", "consumed")

    def __init__(self, matcher) -> None:
        self.matcher, self.consumed = matcher, 0

    def catch_up(self, output_ids: list[int]) -> None:
        """Feed the tokens emitted since the last mask (normally one)."""
        if len(output_ids) > self.consumed:
            self.matcher.consume_tokens(output_ids[self.consumed:])
            self.consumed = len(output_ids)


def mask_rows(logits: torch.Tensor, rows: list[int], tracked: list[Tracked]) -> None:
    """Set logits[row] to -inf wherever the row's grammar forbids the token, in place.

    llguidance fills one bit per token (its numpy helpers: its torch module is a torch.compile'd
    function whose import alone takes seconds), and numpy's unpackbits turns them into booleans."""
    import llguidance.numpy as ln
    import numpy as np

    vocab = logits.shape[-1]
    bitmask = ln.allocate_token_bitmask(len(rows), vocab)
    for i, t in enumerate(tracked):
        ln.fill_next_token_bitmask(t.matcher, bitmask, i)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].view(np.bool_)
    values = logits.numpy()  # the same memory: numpy's masked copy is 3x torch's masked_fill here
    for i, row in enumerate(rows):
        np.copyto(values[row], -np.inf, where=~allowed[i])
