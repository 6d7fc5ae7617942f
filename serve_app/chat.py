"""The chat template: OpenAI messages -> the RWKV chat prompt, and the first reply text tidied.

RWKV chat models are trained on turns separated by a blank line:

    System: You are a helpful assistant.\\n\\nUser: Hi\\n\\nAssistant: Hello!\\n\\nUser: And you?\\n\\nAssistant:

A blank line inside a message would read as the end of its turn, so messages have their blank
lines collapsed to single newlines (as ChatRWKV does); the reply ends at the next blank line (the
template's stop string). Owns the role names, the default system message and those stop strings.
Never touches tokens or the model.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pydantic import BaseModel, Field

from .protocol import ApiError, ChatMessage

_BLANK_LINES = re.compile(r"\n\s*\n")


class ChatTemplate(BaseModel):
    user: str = Field("User", description="the user's role name in the prompt")
    assistant: str = Field("Assistant", description="the assistant's role name in the prompt")
    system: str = Field("System", description="the system role's name in the prompt")
    system_message: str | None = Field(None, description="added first when a request has no system message")
    stop: list[str] = Field(["\n\n"], description="stop strings every chat request gets (the end of a turn)")

    def role_name(self, role: str) -> str:
        names = {"system": self.system, "developer": self.system, "user": self.user, "assistant": self.assistant}
        if role not in names:
            raise ApiError(400, f"unsupported message role {role!r}: use system, developer, user or assistant",
                           param="messages")
        return names[role]


def render(messages: Sequence[ChatMessage], template: ChatTemplate) -> str:
    """The prompt for a chat: every message as a turn, then the assistant's name to answer after."""
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    turns = [f"{template.role_name(m.role)}: {_clean(m.text())}" for m in messages]
    if template.system_message and all(m.role not in ("system", "developer") for m in messages):
        turns.insert(0, f"{template.system}: {_clean(template.system_message)}")
    return "\n\n".join(turns) + f"\n\n{template.assistant}:"


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
