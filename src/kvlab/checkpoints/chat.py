"""Chat templates: the Jinja2 template a checkpoint ships, rendered the way transformers does."""

from __future__ import annotations

from kvlab.plan.errors import PlanError


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         **special_tokens: str) -> str:
    """Render `messages` ([{"role", "content"}]) through a sandboxed Jinja2 environment.

    Sandboxed because a template comes with a downloaded file and must not reach Python;
    `trim_blocks`/`lstrip_blocks` match transformers, so whitespace renders identically.
    """
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise PlanError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **special_tokens)
    except TemplateError as error:
        raise PlanError(f"chat template failed to render: {error}") from None
