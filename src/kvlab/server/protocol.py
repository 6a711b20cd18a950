"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, plus vLLM's extra fields.

Unknown fields are refused (400), as OpenAI refuses them; vLLM's extras are accepted: the
sampling ones `vllm bench serve` sends (top_k, min_p, ignore_eos, stop_token_ids, ...),
`repetition_penalty`, `min_tokens`, `prompt_logprobs` and `structured_outputs`. Values are
checked by kvlab.engine.SamplingParams, which names the bad field. vLLM 0.12 removed the
`guided_*` fields in favour of `structured_outputs`, and so does kvlab: they get a 400 that
says which field to send instead.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvlab.engine.errors import RequestError
from kvlab.engine.sampling import SamplingParams
from kvlab.engine.structured import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
          "guided_whitespace_pattern": "whitespace_pattern", "guided_decoding_backend": None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object (any JSON object) or json_schema (a schema)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    def structured(self) -> Optional[StructuredOutputsParams]:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise RequestError("response_format json_schema needs json_schema.schema", "response_format")
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


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
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    response_format: Optional[ResponseFormat] = None
    # vLLM's extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    repetition_penalty: Optional[float] = None  # vllm bench serve's completions requests always send 1.0
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[dict[str, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def removed_guided_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, field in GUIDED.items():
                if name in data:
                    instead = f'"structured_outputs": {{"{field}": ...}}' if field else "nothing (kvlab has one backend)"
                    raise RequestError(f"{name} was removed in vLLM 0.12 and is not accepted; send {instead}", name)
        return data

    def structured(self) -> Optional[StructuredOutputsParams]:
        from_format = self.response_format.structured() if self.response_format is not None else None
        if self.structured_outputs is not None:
            if from_format is not None:
                raise RequestError("give response_format or structured_outputs, not both", "structured_outputs")
            return StructuredOutputsParams.from_dict(self.structured_outputs)
        return from_format

    def sampling(self, max_tokens: Optional[int], logprobs: Optional[int],
                 prompt_logprobs: Optional[int] = None,
                 structured: Optional[StructuredOutputsParams] = None) -> SamplingParams:
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs are not available when stream=true", "prompt_logprobs")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias, min_tokens=self.min_tokens,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            structured_outputs=structured if structured is not None else self.structured())


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    add_special_tokens: bool = True

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts, one per choice group: a string, a list of strings, token ids or lists of them."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompts = list(prompt)
        else:
            prompts = [prompt]
        if not prompts:
            raise RequestError("the prompt is empty", "prompt")
        if self.suffix or (self.best_of not in (None, 1)):
            raise RequestError("suffix and best_of are not supported", "suffix" if self.suffix else "best_of")
        return prompts

    def params(self) -> SamplingParams:
        """vLLM's rules: echo returns the prompt's log-probabilities when logprobs is set, and
        max_tokens 0 with echo returns the prompt alone (one token is generated and dropped)."""
        max_tokens = self.max_tokens
        if max_tokens == 0:
            if not self.echo:
                raise RequestError("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
            max_tokens = 1
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        return self.sampling(max_tokens, self.logprobs, prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0


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


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template reads them (OpenAI's "developer" is the template's "system")."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: Optional[str] = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None

    def conversation(self) -> list[dict]:
        return conversation(self.messages)

    def tool_mode(self) -> Optional[str]:
        """None (no tools), "named" or "required": the tool calls a JSON schema can force. SmolLM2 has no
        tool-call format, so "auto" (the model deciding when to call) has nothing to parse and is refused."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice in (None, "auto"):
            raise RequestError('tool_choice "auto" needs a tool-call format, which this model has none of: name a '
                               'function ({"type": "function", "function": {"name": ...}}) or send "required"',
                               "tool_choice")
        if self.stream:
            raise RequestError("streamed tool calls are not supported; send stream=false", "stream")
        if self.response_format is not None or self.structured_outputs is not None:
            raise RequestError("tool calls are a structured output already: drop response_format / "
                               "structured_outputs", "tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.name not in {t.function.name for t in self.tools}:
                raise RequestError(f"tool_choice names {self.tool_choice.function.name!r}, which is not in tools",
                                   "tool_choice")
            return "named"
        return "required"

    def tool_structure(self) -> Optional[StructuredOutputsParams]:
        """The JSON schema the output must follow for the tool calls asked (vLLM's, for named and required)."""
        mode = self.tool_mode()
        if mode is None:
            return None
        if mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.tool_choice.function.name)
            return StructuredOutputsParams(json=tool.function.parameters)
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": t.function.parameters},
                  "required": ["name", "parameters"]} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
        if self.parallel_tool_calls is False:  # only an explicit false opts out (OpenAI's default is true)
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def tool_calls(self, text: str) -> list[dict]:
        """The generated text as OpenAI's tool_calls (named: the arguments; required: a list of calls)."""
        import uuid

        def call(name: str, arguments: str) -> dict:
            return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                    "function": {"name": name, "arguments": arguments}}
        if self.tool_mode() == "named":
            return [call(self.tool_choice.function.name, text)]
        try:
            return [call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return []  # cut short by max_tokens: no complete call
