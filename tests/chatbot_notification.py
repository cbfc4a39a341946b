"""The AWS Chatbot custom-notification schema the chat renderings are checked against
(https://docs.aws.amazon.com/chatbot/latest/adminguide/custom-notifs.html, "Event schema"):
version "1.0", source "custom", content {textType client-markdown, title, description, nextSteps,
keywords}, optional id and metadata; nothing else is shown."""

from __future__ import annotations

from typing import Any

from pipeline_steps.diagnosis.handler import CHAT_DESCRIPTION_CHARS

TOP_KEYS = {"version", "source", "id", "content", "metadata"}
CONTENT_KEYS = {"textType", "title", "description", "nextSteps", "keywords"}


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and v.strip() for v in value)


def custom_notification_content(document: Any) -> dict[str, Any]:
    """The content of a custom notification as SNS delivers it; AssertionError says what is wrong."""
    assert isinstance(document, dict) and set(document) <= TOP_KEYS, document
    assert (document.get("version"), document.get("source")) == ("1.0", "custom"), document
    content = document.get("content")
    assert isinstance(content, dict) and set(content) <= CONTENT_KEYS, content
    assert content.get("textType") == "client-markdown", content
    assert isinstance(content.get("title"), str) and content["title"].strip(), content
    description = content.get("description")
    assert isinstance(description, str) and description.strip(), content
    assert len(description) <= CHAT_DESCRIPTION_CHARS, len(description)
    for key in ("nextSteps", "keywords"):
        assert key not in content or _strings(content[key]), content[key]
    return content


def asl_custom_notification_fields(parameters: Any) -> dict[str, Any]:
    """A custom notification as Step Functions Parameters (keys ending in .$ take a path or an
    intrinsic function): checked like `custom_notification_content`, returns content by field name."""
    assert isinstance(parameters, dict) and set(parameters) == {"version", "source", "content"}, parameters
    assert (parameters["version"], parameters["source"]) == ("1.0", "custom"), parameters
    fields = {k.removesuffix(".$"): v for k, v in parameters["content"].items()}
    assert set(fields) <= CONTENT_KEYS and fields["textType"] == "client-markdown", fields
    assert {"title", "description"} <= set(fields), fields
    for key, value in parameters["content"].items():
        if key.endswith(".$"):
            assert isinstance(value, str) and value.startswith(("$.", "States.")), (key, value)
    return fields
