"""Chats render exactly as transformers' ``apply_chat_template(..., tokenize=False)`` renders them.

Real-world templates (Qwen2.5's ChatML with tools, Llama 3.1's, Mistral's that refuses bad roles,
one exercising tojson's arguments, namespace, dict, loop controls and ``{% generation %}``, one
with documents) are rendered by poise and by transformers from the same checkpoint directory, for
many conversations, and must agree character for character, or both refuse.
"""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest
from transformers import AutoTokenizer

from poise import LLM, SamplingParams
from poise.engine.errors import InvalidRequestError, ModelLoadError
from poise.engine.tokenizer import Tokenizer
from poise.modelgen.make_model import make_model
from serverproc import ServerProcess

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 - real templates have long lines

LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""  # noqa: E501 - real templates have long lines

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501 - real templates have long lines

# tojson's arguments, namespace, dict, loop controls, {% generation %} and template kwargs.
TOJSON_TOOLS = """{%- set ns = namespace(turns=0) %}
{%- if tools %}<|im_start|>system
Tools:
{% for tool in tools %}{{ tool | tojson(indent=2, sort_keys=true) }}
{{ tool.function | tojson(separators=(',', ':')) }}
{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}{% continue %}{% endif %}
{%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}{% if message.name is defined %} name={{ message.name }}{% endif %}

{% if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}{% else %}{{ message.content }}{% endif %}
{%- if message.tool_calls is defined %}{{ dict(calls=message.tool_calls) | tojson }}{% endif %}
{%- if message.tool_call_id is defined %} (answers {{ message.tool_call_id }}){% endif %}
<|im_end|>
{%- if ns.turns >= 6 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}
"""  # noqa: E501 - real templates have long lines

DOCUMENTS = """{{ bos_token }}{% if documents %}<|im_start|>system
Answer from these documents only:
{% for doc in documents %}<doc id="{{ loop.index0 }}" title="{{ doc.title }}">{{ doc.text }}</doc>
{% endfor %}<|im_end|>
{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}
{% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}{{ message.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""  # noqa: E501

TEMPLATES = {
    "qwen25": QWEN25,
    "llama31": LLAMA31,
    "mistral": MISTRAL,
    "tojson": TOJSON_TOOLS,
    "documents": DOCUMENTS,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Das Wetter «jetzt» in einer Stadt — e.g. Zürich",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "Name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["°C", "°F"]},
                },
                "required": ["city"],
            },
        },
    }
]
DOCS = [
    {"title": "Zürich", "text": "Zürich liegt am Zürichsee. 東京 is far away."},
    {"title": "Café", "text": "Le café est à côté de la gare."},
]

CHATS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "Hello, who are you?"}],
    "system-unicode": [
        {"role": "system", "content": "Tu es un assistant — réponds en français, s'il te plaît. "},
        {"role": "user", "content": "Quelle heure est-il à Tōkyō? 東京"},
        {"role": "assistant", "content": "Il est midi. 🎉"},
        {"role": "user", "content": "Merci ! Et à Zürich ?"},
    ],
    "tool-turns": [
        {"role": "system", "content": "You call tools when they help."},
        {"role": "user", "content": "What's the weather in Zürich?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "name": "get_weather",
            "content": '{"temp": 21, "sky": "sonnig ☀"}',
        },
        {"role": "assistant", "content": "Es ist 21 °C und sonnig in Zürich."},
    ],
    "reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "Zwei plus zwei ergibt vier."},
        {"role": "user", "content": "And 3+3?"},
    ],
    "bad-roles": [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
    ],
}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("chat") / "base", arch="llama", size="tiny")


def checkpoint(
    base: Path,
    to: Path,
    *,
    jinja: str | None = None,
    config: dict[str, Any] | None = None,
    extra: dict[str, str] | None = None,
    weights: bool = False,
) -> Path:
    """A copy of ``base`` whose tokenizer files are changed as given."""
    to.mkdir(parents=True)
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(base / name, to / name)
    if weights:
        shutil.copy(base / "model.safetensors", to / "model.safetensors")
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    cfg.update(config or {})
    (to / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    if jinja is not None:
        (to / "chat_template.jinja").write_text(jinja)
    for name, text in (extra or {}).items():
        (to / "additional_chat_templates").mkdir(exist_ok=True)
        (to / "additional_chat_templates" / f"{name}.jinja").write_text(text)
    return to


def both(hf: Any, poise: Tokenizer, messages: list[dict[str, Any]], **kw: Any) -> str | None:
    """Render with transformers and poise: the same text, or both refuse (None)."""
    agp = kw.pop("add_generation_prompt", False)
    kwargs = kw.pop("chat_template_kwargs", None) or {}
    try:
        want = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=agp, **kw, **kwargs
        )
    except Exception as exc:
        with pytest.raises(InvalidRequestError) as info:
            poise.apply_chat_template(messages, agp, chat_template_kwargs=kwargs or None, **kw)
        if type(exc) is jinja2.exceptions.TemplateError:  # the template's raise_exception
            assert str(info.value) == str(exc)
        return None
    got = poise.apply_chat_template(messages, agp, chat_template_kwargs=kwargs or None, **kw)
    assert got == want
    return got


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_renders_as_transformers(base_dir, tmp_path, name):
    d = checkpoint(base_dir, tmp_path / name, jinja=TEMPLATES[name])
    hf, poise = AutoTokenizer.from_pretrained(d), Tokenizer(d)
    rendered = refused = 0
    date = {"date_string": "26 Jul 2024"}
    for messages in CHATS.values():
        for agp in (True, False):
            for extra in (
                {},
                {"tools": TOOLS},
                {"documents": DOCS},
                {"chat_template_kwargs": date},
            ):
                text = both(hf, poise, messages, add_generation_prompt=agp, **extra)
                rendered, refused = rendered + (text is not None), refused + (text is None)
    assert rendered >= 20
    if name == "mistral":
        assert refused > 0  # bad roles and tool turns


def test_non_ascii_stays_unescaped_in_tojson(base_dir, tmp_path):
    d = checkpoint(base_dir, tmp_path / "t", jinja=QWEN25)
    text = both(AutoTokenizer.from_pretrained(d), Tokenizer(d), CHATS["tool-turns"], tools=TOOLS)
    assert text is not None and "«jetzt» in einer Stadt — e.g. Zürich" in text
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text


def test_llama31_date_from_strftime_now(base_dir, tmp_path):
    d = checkpoint(base_dir, tmp_path / "t", jinja=LLAMA31)
    hf, poise = AutoTokenizer.from_pretrained(d), Tokenizer(d)
    day = datetime.date.today()
    want = hf.apply_chat_template(CHATS["user"], tokenize=False, add_generation_prompt=True)
    got = poise.apply_chat_template(CHATS["user"])
    if datetime.date.today() == day:  # not across midnight
        assert got == want
        assert f"Today Date: {datetime.datetime.now():%d %b %Y}" in got


def test_continue_final_message(base_dir, tmp_path):
    prefills = [
        [
            {"role": "user", "content": "Ein Haiku über ß?"},
            {"role": "assistant", "content": "Herbst"},
        ],
        [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": "Mond—\n  "}],
        [{"role": "user", "content": "Think"}, {"role": "assistant", "content": None}],
        [{"role": "user", "content": "Parts"}, {"role": "assistant", "content": [{"text": "a "}]}],
    ]
    for name in ("qwen25", "llama31", "documents"):
        d = checkpoint(base_dir, tmp_path / name, jinja=TEMPLATES[name])
        hf, poise = AutoTokenizer.from_pretrained(d), Tokenizer(d)
        date = {"date_string": "1 Jan 2025"}
        for messages in prefills:
            text = both(hf, poise, messages, continue_final_message=True, chat_template_kwargs=date)
            if messages[-1]["content"] == "Herbst":
                assert text is not None and text.endswith("Herbst")
            both(hf, poise, messages, continue_final_message=True, add_generation_prompt=True)
        reasoning = [*CHATS["reasoning"][:2]]
        for field in ("reasoning", "reasoning_content", "content"):
            both(hf, poise, reasoning, continue_final_message=field)


def test_raising_template_is_an_invalid_request(base_dir, tmp_path):
    d = checkpoint(base_dir, tmp_path / "t", jinja=MISTRAL)
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        Tokenizer(d).apply_chat_template(CHATS["bad-roles"])
    with pytest.raises(InvalidRequestError, match="roles are supported"):
        Tokenizer(d).apply_chat_template([*CHATS["user"], {"role": "tool", "content": "x"}])


def test_sandbox_and_bad_requests(base_dir, tmp_path):
    d = checkpoint(base_dir, tmp_path / "t", jinja=DOCUMENTS)
    hf, poise = AutoTokenizer.from_pretrained(d), Tokenizer(d)
    user = CHATS["user"]
    escapes = [
        "{{ ''.__class__.__mro__ }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns._x }}",
        "{{ raise_exception('nope: ' ~ messages[0].content) }}",
        "{{ messages[0].content + 1 }}",
    ]
    for template in escapes:
        assert both(hf, poise, user, chat_template=template) is None
    assert both(hf, poise, user, chat_template="{{ dict.__class__ }}{{ dict(a=1) }}") == "{'a': 1}"
    with pytest.raises(InvalidRequestError) as info:
        poise.apply_chat_template(user, chat_template="{% for %}")
    assert info.value.param == "chat_template"
    with pytest.raises(InvalidRequestError) as info:
        poise.apply_chat_template(user, chat_template_kwargs={"messages": []})
    assert info.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError):
        poise.apply_chat_template([])
    with pytest.raises(InvalidRequestError):
        poise.apply_chat_template(user, documents=["not a dict"])  # type: ignore[list-item]
    # A request's own template, and kwargs that override the special tokens.
    both(hf, poise, user, chat_template="{{ bos_token }}|{{ messages | tojson }}|{{ x }}")
    both(hf, poise, user, chat_template_kwargs={"bos_token": "<s>", "x": [1, "é"]})


def test_template_sources(base_dir, tmp_path):
    default, tool_use = "D:{{ messages[0].content }}", "T:{{ tools | length }}"
    listed = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    cases = {
        "jinja-only": dict(jinja=QWEN25),
        "jinja-beats-config": dict(jinja=QWEN25, config={"chat_template": MISTRAL}),
        "config-string": dict(config={"chat_template": LLAMA31}),
        "config-list": dict(config={"chat_template": listed}),
        "files": dict(jinja=default, extra={"tool_use": tool_use, "plain": "P"}),
        "no-default": dict(extra={"tool_use": tool_use, "plain": "P"}),
        "none": {},
    }
    user = CHATS["user"]
    date = {"date_string": "2 Feb 2025"}
    for name, spec in cases.items():
        d = checkpoint(base_dir, tmp_path / name, **spec)  # type: ignore[arg-type]
        hf, poise = AutoTokenizer.from_pretrained(d), Tokenizer(d)
        if isinstance(hf.chat_template, str):
            assert poise.chat_template == hf.chat_template
        for kw in ({}, {"tools": TOOLS}, {"tools": []}, {"chat_template": "plain"}):
            both(hf, poise, user, chat_template_kwargs=date, **kw)
        both(hf, poise, user, chat_template="tool_use", tools=TOOLS)
    picked = Tokenizer(tmp_path / "config-list")
    assert picked.apply_chat_template(user) == "D:Hello, who are you?"
    assert picked.apply_chat_template(user, tools=TOOLS) == "T:1"
    assert picked.apply_chat_template(user, tools=[]) == "T:0"  # given, though empty
    named = picked.apply_chat_template(user, tools=TOOLS, chat_template="default")
    assert named == "D:Hello, who are you?"
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer(tmp_path / "none").apply_chat_template(user)


def test_processor_chat_template_json_only_when_nothing_else(base_dir, tmp_path):
    d = checkpoint(base_dir, tmp_path / "legacy")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "L:{{ bos_token }}"}))
    assert Tokenizer(d).apply_chat_template(CHATS["user"]) == "L:<|begin_of_text|>"
    (d / "chat_template.jinja").write_text("J")
    assert Tokenizer(d).apply_chat_template(CHATS["user"]) == "J"


def test_broken_model_template_refused_at_load(base_dir, tmp_path):
    d = checkpoint(base_dir, tmp_path / "t", jinja="{% if %}")
    with pytest.raises(ModelLoadError, match="does not parse"):
        Tokenizer(d)


def test_llm_chat_with_only_a_jinja_file(base_dir, tmp_path):
    d = checkpoint(base_dir, tmp_path / "t", jinja=TOJSON_TOOLS, weights=True)
    hf = AutoTokenizer.from_pretrained(d)
    llm = LLM(d)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    messages = CHATS["tool-turns"][:2]
    kw = dict(tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    out = llm.chat(messages, sp, **kw)[0]  # type: ignore[arg-type]
    want = hf.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=False,
        add_generation_prompt=True,
        tools=TOOLS,
        enable_thinking=False,
    )
    assert out.prompt_token_ids == want
    prefill = [*messages, {"role": "assistant", "content": "Ich rufe"}]
    out = llm.chat(prefill, sp, add_generation_prompt=False, continue_final_message=True)[0]
    want = hf.apply_chat_template(
        prefill, tokenize=True, return_dict=False, continue_final_message=True
    )
    assert out.prompt_token_ids == want
    with pytest.raises(InvalidRequestError):
        llm.chat(prefill, sp, continue_final_message=True)  # with add_generation_prompt


@pytest.fixture(scope="module")
def served(base_dir, tmp_path_factory):
    d = checkpoint(base_dir, tmp_path_factory.mktemp("served") / "m", jinja=DOCUMENTS, weights=True)
    proc = ServerProcess(
        d,
        tmp_path_factory.mktemp("logs"),
        "--max-model-len",
        "512",
        "--trust-request-chat-template",
    )
    yield proc, AutoTokenizer.from_pretrained(d)
    proc.stop()


def test_http_chat_reaches_the_template(served):
    proc, hf = served

    def chat(**body: Any) -> httpx.Response:
        body = {"model": "m", "max_tokens": 1, "temperature": 0, **body}
        return httpx.post(proc.url + "/v1/chat/completions", json=body, timeout=30)

    def prompt_tokens(messages: list[dict[str, Any]], **kw: Any) -> int:
        ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kw)
        return len(ids)

    user = CHATS["user"]
    r = chat(messages=user, documents=DOCS)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == prompt_tokens(
        user, documents=DOCS, add_generation_prompt=True
    )
    plain = chat(messages=user).json()["usage"]["prompt_tokens"]
    assert (
        plain
        == prompt_tokens(user, add_generation_prompt=True)
        < r.json()["usage"]["prompt_tokens"]
    )

    prefill = [*CHATS["reasoning"][:1], {"role": "assistant", "content": "Vier, weil"}]
    r = chat(messages=prefill, add_generation_prompt=False, continue_final_message=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == prompt_tokens(prefill, continue_final_message=True)

    thought = [{"role": "assistant", "content": "4", "reasoning_content": "zwei und zwei"}]
    r = chat(messages=[*user, *thought, *user])
    assert r.json()["usage"]["prompt_tokens"] == prompt_tokens(
        [*user, *thought, *user], add_generation_prompt=True
    )

    r = chat(messages=prefill, continue_final_message=True)  # add_generation_prompt defaults on
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    r = chat(messages=user, chat_template="{{ raise_exception('no: ' + messages[0].role) }}")
    assert r.status_code == 400 and r.json()["error"]["message"] == "no: user"
    r = chat(messages=user, chat_template="{% if %}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    r = chat(
        messages=user,
        chat_template="T{{ tools | length }}{{ k }}",
        tools=TOOLS,
        # "none": this template writes no tool-call format, so under "auto" (the default
        # with tools) the calls could not be read, and the request would be a 400.
        tool_choice="none",
        chat_template_kwargs={"k": "é"},
    )
    assert r.json()["usage"]["prompt_tokens"] == len(hf.encode("T1é", add_special_tokens=False))
