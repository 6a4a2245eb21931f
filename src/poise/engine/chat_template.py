"""Chat templates found, picked and rendered exactly as transformers 5 does.

A chat model answers well only for prompts laid out the way it was trained, and its checkpoint
says how in a jinja template that transformers renders. A prompt that differs by one newline is a
different prompt, so this module copies transformers' rules rather than approximating them:

* where templates live: ``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` beside
  the tokenizer, which replace ``tokenizer_config.json``'s ``chat_template`` (a string, or a list
  of ``{name, template}``); ``chat_template.json`` (the processor's legacy file) only when the
  tokenizer has none;
* which one a request gets (``default``, ``tool_use`` when tools are passed, or a name or a whole
  template the request gives);
* the sandboxed environment templates run in, with transformers' ``tojson``, ``raise_exception``,
  ``strftime_now``, ``dict``, ``namespace`` and ``{% generation %}`` tag;
* what a template sees: messages without their None fields, reasoning under all of its names,
  and ``continue_final_message``'s marker-and-trim rule with its errors.

Where transformers raises, the request is refused (``InvalidRequestError``, HTTP 400).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from poise.engine.errors import InvalidRequestError, ModelLoadError

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
LEGACY_TEMPLATE_FILE = "chat_template.json"

# One template, or named ones ("default", "tool_use", ...); None: the model has none.
Templates = str | dict[str, str] | None

# Names a message's reasoning goes by; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# apply_chat_template's own parameters: in transformers such a key never reaches the template.
RESERVED_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


# ----- where templates come from -----


def templates_from_config(value: Any, where: str = "tokenizer_config.json") -> Templates:
    """``tokenizer_config.json``'s ``chat_template``: a string or a list of {name, template}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        try:
            return {str(t["name"]): _template_text(t["template"], where) for t in value}
        except (KeyError, TypeError):
            pass
    raise ModelLoadError(
        f"{where}: chat_template must be a string or a list of {{name, template}} objects"
    )


def load_templates(model_dir: Path, config_value: Any) -> Templates:
    """The templates transformers' AutoTokenizer gives a model directory."""
    files: dict[str, str] = {}
    if (model_dir / TEMPLATE_FILE).is_file():
        files["default"] = (model_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
    template_dir = model_dir / TEMPLATE_DIR
    if template_dir.is_dir():
        for path in sorted(template_dir.glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if len(files) == 1 and "default" in files:
        return files["default"]
    if files:
        return files
    templates = templates_from_config(config_value)
    if templates is not None:
        return templates
    # Only transformers' processors read this file; a text model that has nothing else means it.
    legacy = model_dir / LEGACY_TEMPLATE_FILE
    if legacy.is_file():
        try:
            value = json.loads(legacy.read_text(encoding="utf-8"))["chat_template"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{legacy}: no chat_template string in it") from exc
        return _template_text(value, str(legacy))
    return None


def _template_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ModelLoadError(f"{where}: a chat template must be a string")
    return value


# ----- the environment -----


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it."""

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API declares it so

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """``dict`` for templates: building dicts only, no attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """jinja's namespace, refusing underscore names (a way into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # as jinja's: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                f"got {name!r}. Please rename the attribute."
            )


class _TemplateRaisedError(TemplateError):
    """A template's own ``raise_exception``: the request is what it refuses."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaisedError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Not jinja's own filter, which escapes HTML characters and takes only indent.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _check_jinja() -> None:
    found = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    if found < (3, 1, 6):
        # Older versions have known sandbox escapes; templates are code from the checkpoint.
        raise ModelLoadError(f"chat templates need jinja2>=3.1.6, found {jinja2.__version__}")


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    _check_jinja()
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def _syntax_message(exc: TemplateSyntaxError) -> str:
    return f"line {exc.lineno}: {exc.message}"


# ----- what templates see -----


def _plain(value: Any) -> Any:
    """A fresh copy in plain JSON types, as transformers hands templates (never the caller's)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _message_dict(message: Any) -> dict[str, Any]:
    if callable(getattr(message, "model_dump", None)):
        message = message.model_dump()
    elif dataclasses.is_dataclass(message) and not isinstance(message, type):
        message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    if not isinstance(message, dict):
        raise InvalidRequestError(
            f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.",
            param="messages",
        )
    # Templates handle a missing key; many print "None" for a None one.
    return {k: v for k, v in message.items() if v is not None}


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


# ----- the templates of one model -----


class ChatTemplates:
    """A model's chat templates, compiled once at load."""

    def __init__(self, templates: Templates) -> None:
        self.templates = templates
        self._compiled: dict[str, jinja2.Template] = {}
        named = templates if isinstance(templates, dict) else {"default": templates}
        for name, source in named.items():
            if source is None or source in self._compiled:
                continue
            try:
                self._compiled[source] = _compile(source)
            except TemplateSyntaxError as exc:
                raise ModelLoadError(
                    f"chat template {name!r} does not parse: {_syntax_message(exc)}"
                ) from exc

    @property
    def default(self) -> str | None:
        """The template a plain chat request gets, if the model has one."""
        if isinstance(self.templates, dict):
            return self.templates.get("default")
        return self.templates

    def is_own(self, chat_template: str) -> bool:
        """Whether a request's chat_template names (or is) one of the model's templates."""
        if isinstance(self.templates, dict):
            return chat_template in self.templates or chat_template in self.templates.values()
        return chat_template == self.templates

    def pick(self, chat_template: str | None, tools: list[Any] | None) -> str:
        """transformers' ``get_chat_template``: a name, a whole template, or the model's own."""
        if isinstance(self.templates, dict):
            if chat_template is not None and chat_template in self.templates:
                return self.templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in self.templates:
                    return self.templates["tool_use"]
                if "default" in self.templates:
                    return self.templates["default"]
                raise InvalidRequestError(
                    "this model has several chat templates and none is named 'default': name "
                    f"one in chat_template ({', '.join(sorted(self.templates))})",
                    param="chat_template",
                )
        elif chat_template is None:
            if self.templates is None:
                raise InvalidRequestError("this model has no chat template", param="messages")
            return self.templates
        return chat_template

    def _template(self, source: str) -> jinja2.Template:
        compiled = self._compiled.get(source)
        if compiled is not None:
            return compiled
        try:
            return _compile(source)
        except TemplateSyntaxError as exc:
            raise InvalidRequestError(
                f"chat_template does not parse: {_syntax_message(exc)}", param="chat_template"
            ) from exc

    def render(
        self,
        messages: list[Any],
        *,
        special_tokens: Mapping[str, str],
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """``apply_chat_template(messages, tokenize=False, ...)``: the prompt text."""
        source = self.pick(chat_template, tools)
        template = self._template(source)
        if not messages:
            raise InvalidRequestError(
                "Cannot apply chat template to an empty conversation. "
                "Provide at least one message.",
                param="messages",
            )
        chat = [_message_dict(m) for m in messages]
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final message, "
                "and add_generation_prompt when you want to add a header that will prompt it to "
                "start a new assistant message instead.",
                param="continue_final_message",
            )
        kwargs = dict(template_kwargs or {})
        reserved = sorted(RESERVED_KWARGS.intersection(kwargs))
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs cannot set {', '.join(reserved)}",
                param="chat_template_kwargs",
            )
        if tools is not None and any(not isinstance(t, dict) for t in tools):
            raise InvalidRequestError(
                "Tools should either be a JSON schema, or a callable function with type hints "
                "and a docstring suitable for auto-conversion to a schema.",
                param="tools",
            )
        if documents is not None and any(not isinstance(d, dict) for d in documents):
            raise InvalidRequestError(
                "Documents should be a list of dicts with 'title' and 'text' keys!",
                param="documents",
            )
        kwargs = _plain({**special_tokens, **kwargs})
        chat = [_alias_reasoning(m) for m in _plain(chat)]
        final_message = None
        if continue_final_message:
            final_message = _mark_final_message(chat, continue_final_message, source)
        try:
            rendered = template.render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
        except _TemplateRaisedError as exc:
            raise InvalidRequestError(str(exc), param="messages") from exc
        except InvalidRequestError:
            raise
        except Exception as exc:  # the template met data it cannot handle: the request's
            raise InvalidRequestError(
                f"the chat template failed on this request: {type(exc).__name__}: {exc}",
                param="messages",
            ) from exc
        if final_message is not None:
            rendered = _trim_after_final_message(rendered, final_message)
        return rendered


def _mark_final_message(chat: list[dict[str, Any]], field: bool | str, source: str) -> str:
    """Tag the text to continue, so it can be found (and cut after) in the rendered prompt."""
    name = field if isinstance(field, str) else "content"
    last = chat[-1]
    final_message = last.get(name)
    if final_message is None:
        raise InvalidRequestError(
            f'continue_final_message is set but the final message has no "{name}" to continue!',
            param="continue_final_message",
        )
    fields = [name]
    if name in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if last.get(f) == final_message]
    if not any(f in source for f in fields):
        raise InvalidRequestError(
            f'continue_final_message is set to "{name}" but this is not an accepted field in '
            "the chat_template",
            param="continue_final_message",
        )
    if isinstance(final_message, list | tuple):
        for block in reversed(final_message):
            if isinstance(block, dict) and "text" in block:
                final_message = _text(block["text"])
                block["text"] = final_message + _CONTINUE_TAG
                return final_message
        raise InvalidRequestError(
            "continue_final_message is set but we could not find any text to continue in "
            "the final message!",
            param="continue_final_message",
        )
    final_message = _text(final_message)
    for f in fields:
        last[f] = final_message + _CONTINUE_TAG
    return final_message


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(
            "continue_final_message needs the final message's text to be a string",
            param="continue_final_message",
        )
    return value


def _trim_after_final_message(rendered: str, final_message: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_message.strip() not in rendered or tag not in rendered:
        raise InvalidRequestError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            "portions of the final message.",
            param="continue_final_message",
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]  # the template kept the spacing
    return rendered[:at].rstrip()  # the message's trailing spacing was trimmed
