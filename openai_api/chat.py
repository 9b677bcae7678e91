"""Chat messages -> prompt text, with the model's Jinja chat template (as transformers renders it), or the
file named by `http.chat_template`. A model without either answers chat requests with a clear 400."""
from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from openai_api.protocol import ApiError, Message


def find_chat_template(configured: str, model_path: str) -> str | None:
    """The configured file, else the model folder's chat_template.jinja or tokenizer_config.json's
    `chat_template`; None when there is none."""
    if configured:
        return Path(configured).read_text()
    folder = Path(model_path)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    config = folder / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    return template if isinstance(template, str) else None


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    """transformers' `tojson` for chat templates: plain JSON (Jinja's own escapes <, >, & and ' for HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template; render() gives the prompt that asks the model for the assistant's turn."""

    def __init__(self, source: str, eos_token: str = ""):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise
        environment.filters["tojson"] = _tojson
        self._template = environment.from_string(source)
        self._eos = eos_token

    def render(self, messages: list[Message], tools: list[dict] | None = None) -> str:
        """The prompt; `tools` as transformers passes them (OpenAI's tool objects), None without any."""
        try:
            return self._template.render(messages=[m.for_template() for m in messages], tools=tools,
                                         add_generation_prompt=True, bos_token="", eos_token=self._eos)
        except TemplateError as exc:
            raise ApiError(400, f"messages: the chat template refused them: {exc}", "messages") from exc


def no_template_error(model: str) -> ApiError:
    return ApiError(400, f"model {model!r} has no chat template: use /v1/completions, or configure "
                    "http.chat_template (a Jinja template file)", "messages", code="no_chat_template")
