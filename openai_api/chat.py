"""Chat messages -> prompt text, with the model's Jinja chat template (as transformers renders it), or the
file named by `http.chat_template`. A model without either answers chat requests with a clear 400."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Callable

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from openai_api.protocol import ApiError, Message, TemplateOptions


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
    """A compiled chat template; render() gives the prompt that asks the model for the assistant's turn. Its
    functions are transformers': raise_exception, and strftime_now (today's date, as gpt-oss's and Llama 3's
    templates write it), read from `now`."""

    def __init__(self, source: str, eos_token: str = "", now: Callable[[], datetime] = datetime.now):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = lambda form: now().strftime(form)
        environment.filters["tojson"] = _tojson
        self._template = environment.from_string(source)
        self._reads = meta.find_undeclared_variables(environment.parse(source))     # the variables it reads
        self._eos = eos_token
        # what a client's chat_template_kwargs may not set: what specpool passes, what the request refuses
        # (documents), and the template's own functions (raise_exception, namespace, range, ...)
        self._reserved = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "documents",
                          *environment.globals}

    def render(self, messages: list[Message], tools: list[dict] | None = None,
               options: TemplateOptions | None = None) -> str:
        """The prompt; `tools` as transformers passes them (OpenAI's tool objects), None without any; `options`:
        vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs (default: the prompt that
        asks for a new assistant turn)."""
        options = options or TemplateOptions()
        variables = options.chat_template_kwargs or {}
        reserved = sorted(set(variables) & self._reserved)
        if reserved:
            raise ApiError(400, f"chat_template_kwargs: {reserved[0]!r} is set by specpool or the template",
                           "chat_template_kwargs")
        if options.reasoning_effort is not None:
            variables = {**variables, "reasoning_effort": self._effort(options.reasoning_effort, variables)}
        turns = [m.for_template() for m in messages]
        if options.continue_final_message:
            if messages[-1].content is None:
                raise ApiError(400, "continue_final_message: the final message has no text to continue",
                               "continue_final_message")
            turns[-1]["content"] += CONTINUE
        try:
            prompt = self._template.render(**variables, messages=turns, tools=tools, bos_token="",
                                           eos_token=self._eos, add_generation_prompt=options.add_generation_prompt)
        except (TemplateError, TypeError, ValueError, ArithmeticError, LookupError) as exc:
            param = "chat_template_kwargs" if options.chat_template_kwargs else "messages"    # a client's variable
            raise ApiError(400, f"{param}: the chat template refused them: {exc}", param) from exc
        return continued(prompt) if options.continue_final_message else prompt

    def _effort(self, effort: str, variables: dict) -> str:
        """reasoning_effort, for a template that reads it (else it would change nothing) and not set otherwise in
        chat_template_kwargs."""
        if "reasoning_effort" not in self._reads:
            raise ApiError(400, "reasoning_effort: this model's chat template does not read it (gpt-oss's does), so "
                           "it would change nothing", "reasoning_effort")
        if variables.get("reasoning_effort", effort) != effort:
            raise ApiError(400, f"reasoning_effort: {effort!r}, but chat_template_kwargs sets it to "
                           f"{variables['reasoning_effort']!r}", "reasoning_effort")
        return effort


CONTINUE = "CONTINUE_FINAL_MESSAGE_TAG "    # marks where the final message's text ends (transformers' own mark)


def continued(prompt: str) -> str:
    """The prompt cut where the final message's text ends, so the model continues it (transformers' way): at the
    mark, or where the template trimmed the mark's space, without the whitespace before it."""
    at = prompt.rfind(CONTINUE.strip())
    if at < 0:
        raise ApiError(400, "continue_final_message: the chat template leaves out the final message's text",
                       "continue_final_message")
    return prompt[:at] if prompt[at:at + len(CONTINUE)] == CONTINUE else prompt[:at].rstrip()


def no_template_error(model: str) -> ApiError:
    return ApiError(400, f"model {model!r} has no chat template: use /v1/completions, or configure "
                    "http.chat_template (a Jinja template file)", "messages", code="no_chat_template")
