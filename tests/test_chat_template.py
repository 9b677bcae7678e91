"""vLLM's chat-template parameters (openai_api/chat.py, ChatRequest): add_generation_prompt, continue_final_message
and chat_template_kwargs render the prompt transformers' apply_chat_template renders with the same ones; a
combination vLLM refuses, or a variable specpool sets itself, is a 400 naming the parameter. The whole stack is in
tests/test_openai_http.py (a continued answer).

    python -m pytest -q tests/test_chat_template.py
"""
import pytest
from pydantic import ValidationError

from openai_api.chat import ChatTemplate
from openai_api.protocol import ApiError, ChatRequest

THINKING = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{%- if enable_thinking is defined and enable_thinking is false %}
<think>

</think>
{%- endif %}
{% endif %}"""
TURNS = [{"role": "user", "content": "Write JSON."}, {"role": "assistant", "content": "Sure: {\"a\": "}]


def chat(**body) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": TURNS, **body})


def transformers_renders(messages: list, **options) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, unk_token="x")))
    tokenizer.chat_template = THINKING
    return tokenizer.apply_chat_template(messages, tokenize=False, **options)


@pytest.mark.parametrize("body, options", [
    ({"messages": TURNS[:1]}, {"add_generation_prompt": True}),
    ({"messages": TURNS[:1], "chat_template_kwargs": {"enable_thinking": False}},
     {"add_generation_prompt": True, "enable_thinking": False}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    ({"add_generation_prompt": False, "continue_final_message": True}, {"continue_final_message": True}),
])
def test_the_prompt_is_what_transformers_renders_with_the_same_options(body, options):
    request = chat(**body)
    ours = ChatTemplate(THINKING).render(request.messages, None, request)
    assert ours == transformers_renders([m.for_template() for m in request.messages], **options)
    if body.get("continue_final_message"):
        assert ours.endswith('Sure: {"a": ')          # the answer continues the final message's text


def test_continuing_without_turning_the_generation_prompt_off_is_refused_as_vllm_does():
    with pytest.raises(ValidationError) as refused:
        chat(continue_final_message=True)
    assert refused.value.errors()[0]["loc"] == ("continue_final_message",)


@pytest.mark.parametrize("variables", [{"messages": []}, {"documents": []}, {"raise_exception": 1},
                                       {"namespace": "x"}])
def test_a_variable_specpool_or_the_template_sets_is_refused_naming_chat_template_kwargs(variables):
    request = chat(chat_template_kwargs=variables)
    with pytest.raises(ApiError) as refused:
        ChatTemplate(THINKING).render(request.messages, None, request)
    assert refused.value.param == "chat_template_kwargs"


def test_a_variable_that_breaks_the_template_is_a_400_naming_chat_template_kwargs():
    """A value of the wrong type for the template's own use of it (a Llama 3.1 template adds date_string to text)
    is the client's error, not the server's."""
    request = chat(chat_template_kwargs={"date_string": 5})
    with pytest.raises(ApiError) as refused:
        ChatTemplate('{{ "Today: " + date_string }}').render(request.messages, None, request)
    assert refused.value.param == "chat_template_kwargs" and refused.value.status == 400


def test_reasoning_effort_reaches_a_template_that_reads_it_and_one_that_does_not_refuses_it():
    """gpt-oss's template reads `reasoning_effort` (its default "medium"); a template that does not read it would
    change nothing, so the request is a 400 naming it; a value outside low / medium / high is refused as read."""
    template = ChatTemplate("Reasoning: {{ reasoning_effort | default('medium') }}")
    assert template.render(chat().messages, None, chat(reasoning_effort="low")) == "Reasoning: low"
    assert template.render(chat().messages, None, chat()) == "Reasoning: medium"
    with pytest.raises(ApiError) as refused:
        ChatTemplate(THINKING).render(chat().messages, None, chat(reasoning_effort="high"))
    assert (refused.value.param, refused.value.status) == ("reasoning_effort", 400)
    with pytest.raises(ValidationError) as refused:
        chat(reasoning_effort="max")
    assert refused.value.errors()[0]["loc"] == ("reasoning_effort",)
    assert template.render(chat().messages, None, chat(reasoning_effort="low", chat_template_kwargs={
        "reasoning_effort": "low"})) == "Reasoning: low"
    with pytest.raises(ApiError) as refused:          # set two ways, differently: not silently one of them
        template.render(chat().messages, None, chat(reasoning_effort="low", chat_template_kwargs={
            "reasoning_effort": "high"}))
    assert refused.value.param == "reasoning_effort"
    with pytest.raises(ApiError) as refused:          # the template's own error names the messages, not kwargs
        ChatTemplate("{{ raise_exception('no') }}{{ reasoning_effort }}").render(
            chat().messages, None, chat(reasoning_effort="low"))
    assert refused.value.param == "messages"


def test_strftime_now_writes_the_date_of_the_clock_it_is_given():
    from datetime import datetime
    template = ChatTemplate('Current date: {{ strftime_now("%d %b %Y") }}', now=lambda: datetime(2026, 11, 27))
    assert template.render(chat().messages) == "Current date: 27 Nov 2026"


def test_continuing_a_final_message_without_text_is_refused():
    calls = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    request = chat(messages=[TURNS[0], calls], add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ApiError) as refused:
        ChatTemplate(THINKING).render(request.messages, None, request)
    assert refused.value.param == "continue_final_message"
