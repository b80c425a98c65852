"""Render chat messages to a prompt with the model's own Jinja chat template (pure).

The template comes from the GGUF (``tokenizer.chat_template``), as llama-server does with
``--jinja``. It runs in a sandboxed Jinja environment: templates are data from a model file.
A model file without a template gets its family's turn format where the family is known
(a Gemma model rendered as ChatML reads markers it never saw in training), else ChatML, as
llama-server does.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Gemma's turns: user and model only, so system text opens the next user turn (or one of
# its own when none follows).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = ns.system + m['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if m['role'] != 'assistant' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}"
    "{% endfor %}"
    "{% if ns.system %}<start_of_turn>user\n{{ ns.system | trim }}<end_of_turn>\n{% endif %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
FAMILY_TEMPLATES = {"gemma": GEMMA_TEMPLATE, "gemma2": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE}


def fallback_template(architecture: str) -> str:
    """The turn format for a model file that carries no chat template, by its
    ``general.architecture``."""
    return FAMILY_TEMPLATES.get(architecture, CHATML_TEMPLATE)


class ChatTemplateError(ValueError):
    """The messages could not be rendered (the template raised or is malformed)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def canonical(value: Any) -> Any:
    """Dicts with sorted keys, recursively. Tool definitions are rendered canonically so the
    same tools give the same tokens whatever key order a client (or the Kubernetes API
    server, which sorts keys) sends them in: otherwise a pool's prefix stops matching at the
    tools block."""
    if isinstance(value, dict):
        return {k: canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


class ChatRenderer:
    def __init__(
        self, template: str | None, bos_token: str, eos_token: str, architecture: str = ""
    ) -> None:
        self.source = template or fallback_template(architecture)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        variables: dict[str, Any] = dict(extra or {})
        variables.update(
            messages=messages,
            tools=canonical(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        try:
            return self._template.render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
