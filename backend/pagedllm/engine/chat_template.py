"""Turns an OpenAI-format conversation into prompt text with a Jinja chat template: the tokenizer's own (for a
GGUF file, the one in its metadata), unless engine config `chat_template` or the request names another.

Messages are checked before rendering, so a malformed conversation gets a ValueError naming the message and the
field rather than a template error: a list of objects with a `role` string and a `content` that is a string or a
list of `{"type": "text", "text": ...}` parts (joined with newlines, as vLLM does); `name` is passed through.
Images, audio and tool calls are refused: this engine is text-only and has no tool parser.
"""

from __future__ import annotations

import os

_ROLES = ("system", "user", "assistant", "developer")
_MESSAGE_KEYS = {"role", "content", "name"}


class ChatTemplate:
    def __init__(self, tokenizer, override: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.default = _template_text(override) if override else getattr(tokenizer, "chat_template", None)

    def render(self, messages, add_generation_prompt: bool = True, chat_template: str | None = None) -> str:
        """Raises ValueError: a malformed conversation, no template, or a template that refuses it."""
        template = _template_text(chat_template) if chat_template else self.default
        if not template:
            raise ValueError("messages: this model's tokenizer has no chat template; set `chat_template` in the "
                             "engine config (or send text_input / a plain prompt instead)")
        conversation = check_messages(messages)
        try:
            text = self.tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2's TemplateError, or a template's own raise_exception("...")
            raise ValueError(f"messages: the chat template refused them: {type(e).__name__}: {e}") from None
        if not isinstance(text, str):
            raise ValueError("messages: the chat template did not render to text")
        return text


def check_messages(messages) -> list[dict]:
    """The conversation with every content as a string."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: expected a non-empty list of message objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: expected an object, got {type(m).__name__}")
        extra = sorted(set(m) - _MESSAGE_KEYS)
        if extra:
            raise ValueError(f"{where}: unsupported field(s) {extra} (text messages only: role, content, name)")
        role = m.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}.role: expected one of {', '.join(_ROLES)}, got {role!r}")
        if "name" in m and not isinstance(m["name"], str):
            raise ValueError(f"{where}.name: expected a string")
        out.append({**m, "content": _content_text(m.get("content"), f"{where}.content")})
    return out


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: expected a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported, "
                             f"got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _template_text(template: str) -> str:
    """A template is given inline or as the path of a file holding it (vLLM's --chat-template takes both)."""
    if "{" not in template and os.path.isfile(template):
        with open(template) as f:
            return f.read()
    return template
