"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, plus vLLM's extra fields.

Unknown fields are refused (400), as OpenAI refuses them; vLLM's sampling extras that users
of `vllm bench serve` send (top_k, min_p, ignore_eos, stop_token_ids, ...) are accepted.
Values are checked by kvlab.engine.SamplingParams, which names the bad field.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from kvlab.engine.errors import RequestError
from kvlab.engine.sampling import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0  # vllm bench serve's completions requests always send 1.0

    def sampling(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        if self.n != 1:
            raise RequestError("only n=1 is supported", "n")
        if self.presence_penalty or self.frequency_penalty:
            raise RequestError("presence_penalty and frequency_penalty are not supported", "presence_penalty")
        if self.min_tokens:
            raise RequestError("min_tokens is not supported", "min_tokens")
        if self.repetition_penalty != 1.0:
            raise RequestError("only repetition_penalty=1.0 (none) is supported", "repetition_penalty")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def single_prompt(self) -> Union[str, list[int]]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError("one prompt per request (send several requests: they are batched)", "prompt")
            prompt = prompt[0]
        if self.echo or self.suffix or (self.best_of not in (None, 1)):
            raise RequestError("echo, suffix and best_of are not supported", "echo")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}]
            if not all(isinstance(part, dict) and part.get("type") == "text" for part in self.content):
                raise RequestError("only text content parts are supported", "messages")
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None

    def conversation(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]
