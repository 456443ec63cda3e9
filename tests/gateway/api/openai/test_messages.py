"""Chat messages -> stored items, and reconciling them with a session (no server needed)."""

from __future__ import annotations

import msgspec
import pytest

from gateway.api.openai.chat.messages import parse_messages, reconcile, same_item
from gateway.api.openai.chat.protocol import ChatCompletionRequest
from gateway.chat.requests import RequestLimits
from gateway.protocol.errors import GatewayError
from gateway.sessions.session import Session, StoredItem, StoredPart
from gateway.testing.images import data_url
from tests.conftest import photo_bytes

LIMITS = RequestLimits(
    max_output_tokens_limit=64,
    max_text_chars=100,
    max_images_per_session=4,
    max_items_per_session=16,
    max_image_bytes=2 * 1024 * 1024,
    max_pixels=4_000_000,
)


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def parse(messages: list[dict]):
    request = msgspec.convert({"model": "m", "messages": messages}, ChatCompletionRequest)
    return parse_messages(request.messages, LIMITS)


def test_leading_system_messages_become_instructions() -> None:
    conv = parse(
        [
            {"role": "system", "content": "A."},
            {"role": "developer", "content": "B."},
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "later"},
        ]
    )
    assert conv.instructions == "A.\n\nB."
    assert [i.role for i in conv.items] == ["user", "system"]


def test_images_are_stored_by_digest_once() -> None:
    image = photo_bytes("astronaut", size=64)
    part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    conv = parse(
        [
            {"role": "user", "content": [part, {"type": "text", "text": "q"}]},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": [part]},
        ]
    )
    assert len(conv.inline) == 1
    digest = next(iter(conv.inline))
    assert conv.items[0].parts[0].digest == digest == conv.items[2].parts[0].digest


@pytest.mark.parametrize(
    ("messages", "code", "param"),
    [
        ([], "invalid_request", "messages"),
        (
            [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}],
            "invalid_request",
            "messages[1].tool_call_id",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "tool", "tool_call_id": "call_9", "content": "r"},
            ],
            "invalid_request",
            "messages[1].tool_call_id",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [CALL]},
                {
                    "role": "tool",
                    "tool_call_id": "call_1",
                    "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                },
            ],
            "invalid_request",
            "messages[2].content[0].type",
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "x" * 101},
            ],
            "input_too_large",
            "messages[2].content",
        ),
        (
            [{"role": "user", "content": "q", "tool_calls": [CALL]}],
            "invalid_request",
            "messages[0].tool_calls",
        ),
        (
            [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}],
            "invalid_request",
            "messages[0].function_call",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "", "arguments": "{}"}}],
                }
            ],
            "invalid_request",
            "messages[0].tool_calls[0].function.name",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "x" * 101}}],
                }
            ],
            "input_too_large",
            "messages[0].tool_calls[0].function.arguments",
        ),
        ([{"role": "user", "content": []}], "invalid_request", "messages[0].content"),
        (
            [
                {
                    "role": "assistant",
                    "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                }
            ],
            "invalid_request",
            "messages[0].content[0].type",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ],
            "invalid_image",
            "messages[0].content[0].image_url.url",
        ),
        (
            [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}],
            "invalid_request",
            "messages[0].content[0].type",
        ),
        ([{"role": "user", "content": None}], "invalid_request", "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "x" * 101}]}],
            "input_too_large",
            "messages[0].content[0].text",
        ),
        (
            [
                {"role": "system", "content": "x" * 60},
                {"role": "system", "content": "y" * 60},
                {"role": "user", "content": "hi"},
            ],
            "input_too_large",
            "messages",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": data_url(photo_bytes("astronaut", size=8 + i))},
                        }
                        for i in range(5)
                    ],
                }
            ],
            "too_many_images",
            "messages[0].content",
        ),
    ],
)
def test_refusals(messages: list[dict], code: str, param: str) -> None:
    with pytest.raises(GatewayError) as caught:
        parse(messages)
    assert (caught.value.code, caught.value.param) == (code, param)


def test_an_assistant_turn_without_content_is_empty_text() -> None:
    conv = parse(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "again"},
        ]
    )
    assert [p.text for i in conv.items for p in i.parts] == ["q", "", "again"]


def test_instructions_alone_are_a_conversation() -> None:
    conv = parse([{"role": "system", "content": "Say hi."}])
    assert conv.instructions == "Say hi." and conv.items == []


def test_tool_calls_and_results() -> None:
    conv = parse(
        [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "sun"}],
            },
            {"role": "assistant", "content": "sunny", "tool_calls": [{**CALL, "id": "call_2"}]},
        ]
    )
    assistant, tool, both = conv.items[1:]
    assert assistant.parts == [
        StoredPart("tool_call", text="{}", name="get_weather", call_id="call_1")
    ]
    assert (tool.role, tool.parts) == ("tool", [StoredPart("text", text="sun", call_id="call_1")])
    assert [p.kind for p in both.parts] == ["text", "tool_call"]
    # content "" beside calls is the same message as content null
    again = parse(
        [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
        ]
    )
    assert same_item(assistant, again.items[1])


def test_a_replayed_tool_call_matches_only_itself() -> None:
    stored = parse([{"role": "assistant", "tool_calls": [CALL]}]).items[0]

    def replay(**changes: object) -> StoredItem:
        function = {**CALL["function"], **changes.pop("function", {})}  # type: ignore[dict-item]
        call = {**CALL, **changes, "function": function}
        return parse([{"role": "assistant", "tool_calls": [call]}]).items[0]

    assert same_item(stored, replay())
    assert not same_item(stored, replay(id="call_2"))
    assert not same_item(stored, replay(function={"name": "other"}))
    assert not same_item(stored, replay(function={"arguments": '{"a": 1}'}))


def test_images_are_counted_across_messages() -> None:
    def msg(i: int) -> dict:
        url = data_url(photo_bytes("astronaut", size=8 + i))
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}

    assert len(parse([msg(i) for i in range(4)]).inline) == 4
    with pytest.raises(GatewayError) as caught:
        parse([msg(i) for i in range(5)])
    assert (caught.value.code, caught.value.param) == ("too_many_images", "messages")


def session() -> Session:
    return Session.new("anonymous", instructions="default", max_output_tokens=16)


def test_reconcile_appends_only_what_is_new() -> None:
    s = session()
    first = parse([{"role": "user", "content": "q1"}])
    assert reconcile(s, first, "default") == 0
    s.items.append(
        parse([{"role": "assistant", "content": "a1"}, {"role": "user", "content": "x"}]).items[0]
    )
    ids = [i.id for i in s.items]
    second = parse(
        [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
        ]
    )
    assert reconcile(s, second, "default") == 2
    assert [i.id for i in s.items][:2] == ids  # stored items kept as they were
    assert [p.text for i in s.items for p in i.parts] == ["q1", "a1", "q2"]


def test_reconcile_replaces_a_diverging_conversation() -> None:
    s = session()
    reconcile(
        s,
        parse([{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]),
        "default",
    )
    assert (
        reconcile(
            s,
            parse([{"role": "system", "content": "new"}, {"role": "user", "content": "other"}]),
            "default",
        )
        == 0
    )
    assert [p.text for i in s.items for p in i.parts] == ["other"]
    assert s.instructions == "new"
