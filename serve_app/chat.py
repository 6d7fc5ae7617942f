"""The chat template: OpenAI messages -> the RWKV chat prompt, and the first reply text tidied.

RWKV chat models are trained on turns separated by a blank line:

    System: You are a helpful assistant.\\n\\nUser: Hi\\n\\nAssistant: Hello!\\n\\nUser: And you?\\n\\nAssistant:

A blank line inside a message would read as the end of its turn, so messages have their blank
lines collapsed to single newlines (as ChatRWKV does); the reply ends at the next blank line (the
template's stop string). Owns the role names, the default system message, those stop strings,
and the system turn that lists the tools when the reply is to call one (a call, and a tool's
result, are turns like the others). Never touches tokens or the model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from pydantic import BaseModel, Field

from .protocol import ApiError, ChatMessage, ChatTools, Tool

_BLANK_LINES = re.compile(r"\n\s*\n")


class ChatTemplate(BaseModel):
    user: str = Field("User", description="the user's role name in the prompt")
    assistant: str = Field("Assistant", description="the assistant's role name in the prompt")
    system: str = Field("System", description="the system role's name in the prompt")
    tool: str = Field("Tool", description="the role name of a tool's result in the prompt")
    system_message: str | None = Field(None, description="added first when a request has no system message")
    stop: list[str] = Field(["\n\n"], description="stop strings every chat request gets (the end of a turn)")

    def role_name(self, role: str) -> str:
        names = {"system": self.system, "developer": self.system, "user": self.user, "assistant": self.assistant,
                 "tool": self.tool}
        if role not in names:
            raise ApiError(400, f"unsupported message role {role!r}: use system, developer, user, assistant or tool",
                           param="messages")
        return names[role]


def render_request(chat: ChatTools, template: ChatTemplate) -> str:
    """A chat request's prompt: its messages, and its tools when the reply may call them."""
    tools = chat.tools if chat.calls_tool else ()
    return render(chat.messages or [], template, tools, required=not chat.tool_auto, several=chat.parallel_calls)


def render(messages: Sequence[ChatMessage], template: ChatTemplate, tools: Sequence[Tool] = (),
           required: bool = True, several: bool = False) -> str:
    """The prompt for a chat: every message as a turn, then the assistant's name to answer after.
    `tools`, when the reply may call one: a system turn saying which (and, unless `required`,
    that it may answer in text; with `several`, that several calls go a line each), before the
    first message that is not a system message."""
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    turns = [f"{template.role_name(m.role)}: {_clean(m.text())}" for m in messages]
    system = [m.role in ("system", "developer") for m in messages]
    if tools:
        turns.insert(system.index(False) if False in system else len(turns),
                     f"{template.system}: {_tools_text(tools, required, several)}")
    if template.system_message and not any(system):
        turns.insert(0, f"{template.system}: {_clean(template.system_message)}")
    return "\n\n".join(turns) + f"\n\n{template.assistant}:"


def _tools_text(tools: Sequence[Tool], required: bool, several: bool) -> str:
    call = 'a JSON object {"name": ..., "arguments": {...}}' + (" (several calls: one a line)" if several else "")
    lines = [f"Answer by calling one of these tools, as {call}:" if required else
             f"You may call one of these tools, answering with nothing but {call}; else answer in text:"]
    for tool in tools:
        f = tool.function
        parameters = json.dumps(f.parameters or {"type": "object"})
        described = f"- {f.name}: {_clean(f.description)}" if f.description else f"- {f.name}"
        lines.append(f"{described}; arguments: {parameters}")
    return "\n".join(lines)


def _clean(text: str) -> str:
    return _BLANK_LINES.sub("\n", text.replace("\r\n", "\n").strip())


class LeadingSpace:
    """Drops the whitespace a reply starts with (the model writes "Assistant: Hello")."""

    def __init__(self) -> None:
        self.started = False

    def strip(self, text: str) -> str:
        if self.started:
            return text
        text = text.lstrip()
        self.started = bool(text)
        return text
