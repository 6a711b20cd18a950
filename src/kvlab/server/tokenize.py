"""vLLM's tokenizer endpoints' bodies: /tokenize (a prompt, or chat messages), /detokenize, /tokenizer_info."""

from __future__ import annotations

from typing import Annotated, Optional

from pydantic import BaseModel, ConfigDict, Field

from kvlab.server.protocol import ChatMessage, conversation


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's BOS, where it adds one
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def conversation(self) -> list[dict]:
        return conversation(self.messages)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    tokens: list[Annotated[int, Field(ge=0)]]


def tokenizer_info(tokenizer, max_model_len: int) -> dict:
    """The tokenizer's configuration, as tokenizer_config.json holds it (vLLM's TokenizerInfoResponse)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.token(tokenizer.bos_id),
            "eos_token": tokenizer.token(tokenizer.eos_id), "pad_token": None,
            "add_bos_token": tokenizer.add_bos, "chat_template": tokenizer.chat_template,
            "model_max_length": max_model_len}
