"""Tokenizers rebuilt from what a GGUF file stores, plus streaming decode and HF save/load.

GGUF keeps a tokenizer as plain arrays (`tokenizer.ggml.tokens`, `scores`, `token_type`,
`merges`) and a `model` name:
- "llama": SentencePiece BPE. The merge order is implied by the scores (a merge that makes a
  higher-scoring piece happens first, llama2.c's rule), text gets a "▁" prefix and spaces
  become "▁", and characters outside the vocabulary fall back to `<0xXX>` byte pieces.
  transformers cannot build this for stories260K (its pad id is 2^32 - 1), so we do it here.
- "gpt2": byte-level BPE with explicit merges (SmolLM2). llama.cpp's "smollm" pre-tokenizer
  splits digits one by one before the GPT-2 regex.
Both end up as a `tokenizers.Tokenizer`, so saving to a Hugging Face directory is one call.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Optional, Sequence

from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers, processors

from kvlab.plan.errors import PlanError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPIECE_SPACE = "\u2581"


class Tokenizer:
    """Text <-> ids with the model's special tokens and chat template attached."""

    def __init__(self, backend: Backend, bos_id: Optional[int], eos_id: Optional[int], add_bos: bool,
                 chat_template: Optional[str] = None):
        self.backend, self.bos_id, self.eos_id, self.add_bos = backend, bos_id, eos_id, add_bos
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token(self, token_id: Optional[int]) -> Optional[str]:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def encode(self, text: str, add_bos: Optional[bool] = None) -> list[int]:
        try:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        except TypeError:  # the Rust tokenizer refuses lone surrogates ("\ud800"), which JSON can carry
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise PlanError(f"the text is not valid Unicode: {error.reason} at position {error.start}") from None
            raise
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from kvlab.checkpoints.chat import render_chat_template
        if not self.chat_template:
            raise PlanError("this model has no chat template; drop --chat")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.token(self.bos_id) or "", eos_token=self.token(self.eos_id) or "")

    def save(self, directory: str) -> None:
        """tokenizer.json and tokenizer_config.json, as a Hugging Face directory holds them.

        A tokenizer that starts text with BOS saves a post-processor that puts it there, so
        transformers' AutoTokenizer (and vLLM, which tokenizes with it) encodes as `encode`
        does: transformers' generic fast tokenizer ignores `add_bos_token`. `encode` itself
        skips post-processing, so kvlab's ids do not change.
        """
        previous = self.backend.post_processor
        if self.add_bos and self.bos_id is not None:
            bos = self.token(self.bos_id)
            self.backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)])
        try:
            self.backend.save(os.path.join(directory, "tokenizer.json"))
        finally:
            self.backend.post_processor = previous
        config = {"bos_token": self.token(self.bos_id), "eos_token": self.token(self.eos_id),
                  "add_bos_token": self.add_bos, "tokenizer_class": "PreTrainedTokenizerFast"}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)

    @classmethod
    def load(cls, directory: str) -> "Tokenizer":
        backend = Backend.from_file(os.path.join(directory, "tokenizer.json"))
        config_path = os.path.join(directory, "tokenizer_config.json")
        config = json.load(open(config_path)) if os.path.exists(config_path) else {}

        def special(key: str) -> Optional[int]:
            value = config.get(key)
            content = value.get("content") if isinstance(value, dict) else value
            return backend.token_to_id(content) if content else None

        return cls(backend, special("bos_token"), special("eos_token"), bool(config.get("add_bos_token", False)),
                   config.get("chat_template"))


class TextStream:
    """Turns ids arriving one at a time into text pieces, never splitting a UTF-8 character.

    Byte-fallback and byte-level tokens can end mid-character; decoding the whole tail and
    holding back a trailing U+FFFD until the next token completes it keeps streams valid.
    `context` (the prompt's last ids) is decoded in front, so a SentencePiece word piece
    keeps the leading space that decoding it alone would strip.
    """

    def __init__(self, tokenizer: Tokenizer, write: Callable[[str], None], context: Sequence[int] = ()):
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = list(context)
        self.skip = len(tokenizer.decode(self.ids))
        self.emitted = 0

    def push(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)[self.skip:]
        if not text.endswith("\ufffd"):
            self._emit(text)

    def flush(self) -> None:
        self._emit(self.tokenizer.decode(self.ids)[self.skip:])

    def _emit(self, text: str) -> None:
        if len(text) > self.emitted:
            self.write(text[self.emitted:])
            self.emitted = len(text)


def tokenizer_from_gguf(meta: dict) -> Tokenizer:
    """Build the tokenizer a GGUF file describes (`meta` maps metadata keys to values)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise PlanError("this GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "llama":
        backend = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types,
                                     meta.get("tokenizer.ggml.unknown_token_id", 0),
                                     bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        add_bos_default = True
    elif kind == "gpt2":
        backend = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
        add_bos_default = False
    else:
        raise PlanError(f"unsupported GGUF tokenizer model {kind!r} (kvlab reads 'llama' and 'gpt2')")
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)])
    if kind == "llama":  # SentencePiece matches user-defined pieces whole, before BPE, on the raw text
        # (llama.cpp's converter writes their "▁" back as spaces, e.g. Gemma's runs of spaces and newlines)
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i, t in enumerate(types) if t == USER_DEFINED])

    def token_id(key: str) -> Optional[int]:
        value = meta.get(key)
        return value if isinstance(value, int) and 0 <= value < len(tokens) else None  # 2^32-1 means "none"

    return Tokenizer(backend, token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id"),
                     bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                     meta.get("tokenizer.chat_template"))


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], unk_id: int,
                       add_space_prefix: bool = True) -> Backend:
    """SentencePiece's BPE as a `tokenizers` BPE: merges ranked by the merged piece's score.
    `add_space_prefix` False (Gemma) keeps the text's own start: no "▁" is prepended."""
    vocab = {piece: i for i, piece in enumerate(tokens)}
    mergeable = [i for i, t in enumerate(types) if t == NORMAL]  # user-defined pieces are added tokens
    merges = []
    for i in sorted(mergeable, key=lambda i: (-scores[i], i)):
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    unk = tokens[unk_id] if 0 <= unk_id < len(tokens) else None
    backend = Backend(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = [normalizers.Prepend(SPIECE_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", SPIECE_SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()] + strip)
    return backend


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: Optional[str]) -> Backend:
    vocab = {piece: i for i, piece in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = Backend(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def prompt_ids(tokenizer: "Tokenizer", text: str, chat: bool) -> list[int]:
    """A prompt's ids as `kvlab generate` feeds them: a chat turn rendered by the model's template (its own
    BOS, if any), or plain text after BOS; an empty prompt is BOS alone (an error for a model without one)."""
    if chat:
        text = tokenizer.render_chat([{"role": "user", "content": text}])
        return tokenizer.encode(text, add_bos=False) if tokenizer.bos_id is None else tokenizer.encode(text)
    ids = tokenizer.encode(text) if text else []
    if not ids:
        if tokenizer.bos_id is None:
            raise PlanError("this model has no BOS token; give a --prompt")
        ids = [tokenizer.bos_id]
    return ids
