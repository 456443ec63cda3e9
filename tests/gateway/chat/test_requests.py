"""The request layer's checks on their own: boundaries, codes and the params they name."""

from __future__ import annotations

import functools
import io
import math

import pytest

from gateway.caching import make_image_store, make_vision_cache
from gateway.chat.image_input import REF_PREFIX, digest_of
from gateway.chat.requests import (
    EXTRA_PARTS,
    MAX_SEED,
    ContentPart,
    RequestLimits,
    add_inline_images,
    check_image_bytes,
    check_image_count,
    check_instructions,
    check_item_count,
    check_max_tokens,
    check_output_modalities,
    check_sampling,
    check_stop,
    check_text,
    fetch_remote,
    parse_content,
    refuse_unsupported,
    resolve_references,
    response_options,
)
from gateway.chat.vision_resolver import VisionResolver
from gateway.engine.interface import (
    MAX_STOP_CHARS,
    MAX_STOPS,
    EngineError,
    GenerationRequest,
    Message,
    SamplingParams,
)
from gateway.engine.local.sequence import check_request
from gateway.protocol.errors import ERROR_CODES, GatewayError
from gateway.settings import Settings
from gateway.testing.fakes import FakeEncoder
from gateway.testing.images import data_url as any_data_url

MiB = 1024 * 1024
LIMITS = RequestLimits(
    max_output_tokens_limit=100,
    max_text_chars=50,
    max_images_per_session=2,
    max_items_per_session=4,
    max_image_bytes=64 * 1024,
    max_pixels=100_000,
)


def refused(call, *args, **kwargs) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        call(*args, **kwargs)
    assert caught.value.code in ERROR_CODES and caught.value.message
    return caught.value


def png(size: int = 16, color: tuple[int, int, int] = (10, 20, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="PNG")
    return buf.getvalue()


data_url = functools.partial(any_data_url, mime="image/png")  # every image here is a PNG


def test_limits_are_read_from_settings() -> None:
    settings = Settings.load(
        dict(
            max_output_tokens_limit=300,
            max_output_tokens=30,
            max_text_chars=7,
            max_images_per_session=3,
            max_items_per_session=9,
            max_image_bytes=2 * MiB,
            max_pixels=5000,
            image_url_allowlist=["https://img.example.com/a/"],
        ),
        environ={},
    )
    limits = RequestLimits.of(settings)
    assert limits == RequestLimits(
        300, 7, 3, 9, 2 * MiB, 5000, ("https://img.example.com/a/",), max_output_tokens=30
    )
    assert limits.max_parts_per_message == 3 + EXTRA_PARTS


# ---------------------------------------------------------------- sampling and tokens


@pytest.mark.parametrize(
    ("temperature", "top_p", "seed"),
    [
        (0.0, 1.0, 0),
        (2.0, 1e-9, MAX_SEED - 1),
        (None, None, None),
        (1.0, 0.5, 7),
    ],
)
def test_sampling_in_range_passes(temperature, top_p, seed) -> None:
    check_sampling(temperature, top_p, seed, where="response.")


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        (dict(temperature=-0.001), "temperature"),
        (dict(temperature=2.001), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.0001), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=MAX_SEED), "seed"),
        (dict(seed=True), "seed"),
    ],
)
@pytest.mark.parametrize("where", ["", "response.", "session."])
def test_sampling_out_of_range_is_invalid_request(kwargs: dict, param: str, where: str) -> None:
    values = {"temperature": None, "top_p": None, "seed": None, **kwargs}
    err = refused(
        check_sampling, values["temperature"], values["top_p"], values["seed"], where=where
    )
    assert (err.code, err.param) == ("invalid_request", where + param)


def test_max_tokens_boundaries() -> None:
    assert check_max_tokens(None, 100, "max_tokens") is None
    assert check_max_tokens(1, 100, "max_tokens") == 1
    assert check_max_tokens(100, 100, "max_tokens") == 100
    assert check_max_tokens("inf", 100, "response.max_output_tokens", allow_inf=True) == 100
    for bad in (0, -1, 101, True):
        err = refused(check_max_tokens, bad, 100, "max_completion_tokens")
        assert (err.code, err.param) == ("invalid_request", "max_completion_tokens")
        assert "1..100" in err.message and "inf" not in err.message
    # "inf" is the Realtime API's word; where it is not allowed it is a bad value like any other
    err = refused(check_max_tokens, "inf", 100, "max_tokens")
    assert (err.code, err.param) == ("invalid_request", "max_tokens")
    err = refused(check_max_tokens, 0, 100, "session.max_output_tokens", allow_inf=True)
    assert err.param == "session.max_output_tokens" and '"inf"' in err.message


def test_stop_strings_are_bounded_like_the_engine() -> None:
    assert check_stop(None) == ()
    assert check_stop("END") == ("END",)
    widest = ["x" * MAX_STOP_CHARS] * MAX_STOPS
    assert check_stop(widest) == tuple(widest)
    err = refused(check_stop, ["a"] * (MAX_STOPS + 1))
    assert (err.code, err.param) == ("invalid_request", "stop")
    err = refused(check_stop, ["a", "y" * (MAX_STOP_CHARS + 1)])
    assert (err.code, err.param) == ("invalid_request", "stop[1]")
    err = refused(check_stop, "z" * (MAX_STOP_CHARS + 1))
    assert (err.code, err.param) == ("invalid_request", "stop")
    err = refused(check_stop, ["ok", ""])
    assert (err.code, err.param) == ("invalid_request", "stop[1]")


@pytest.mark.parametrize(
    "stop",
    [
        ["x" * MAX_STOP_CHARS] * MAX_STOPS,
        ["a"] * (MAX_STOPS + 1),
        ["y" * (MAX_STOP_CHARS + 1)],
    ],
)
def test_gateway_and_engine_agree_on_stop_strings(stop: list[str]) -> None:
    """What the gateway admits the engine runs; what it refuses the engine would refuse after
    the stream started."""
    request = GenerationRequest(
        "r", [Message("user", ["hi"])], SamplingParams(max_output_tokens=4, stop=tuple(stop))
    )
    try:
        check_stop(stop)
        gateway_ok = True
    except GatewayError:
        gateway_ok = False
    try:
        check_request(request, hidden=8)
        engine_ok = True
    except EngineError:
        engine_ok = False
    assert gateway_ok == engine_ok


def test_text_and_instructions_lengths() -> None:
    assert check_text("x" * 50, LIMITS, "p") == "x" * 50
    assert check_instructions(None, LIMITS, "p") is None
    assert check_instructions("y" * 50, LIMITS, "p") == "y" * 50
    err = refused(check_text, "x" * 51, LIMITS, "messages[0].content")
    assert (err.code, err.param) == ("input_too_large", "messages[0].content")
    err = refused(check_instructions, "y" * 51, LIMITS, "session.instructions")
    assert (err.code, err.param) == ("input_too_large", "session.instructions")


def test_counts() -> None:
    check_item_count(4, LIMITS, "messages")
    err = refused(check_item_count, 5, LIMITS, "messages")
    assert (err.code, err.param) == ("input_too_large", "messages")
    check_image_count(["a", "b", "a", "b"], LIMITS, None)  # distinct images count
    err = refused(check_image_count, ["a", "b", "c"], LIMITS, "item.content")
    assert (err.code, err.param) == ("too_many_images", "item.content")


def test_unsupported_features_and_modalities() -> None:
    refuse_unsupported(None, "tools", "tools are not supported")
    refuse_unsupported([], "tools", "tools are not supported")
    err = refused(refuse_unsupported, [{"type": "function"}], "tools", "tools are not supported")
    assert (err.code, err.param) == ("invalid_request", "tools")
    err = refused(refuse_unsupported, [], "response.input", "no input", allow_empty=False)
    assert (err.code, err.param) == ("invalid_request", "response.input")
    check_output_modalities(None, "m")
    check_output_modalities(["text"], "m")
    err = refused(check_output_modalities, ["text", "audio"], "response.output_modalities")
    assert (err.code, err.param) == ("invalid_request", "response.output_modalities")


def test_response_options_from_checked_values() -> None:
    options = response_options(
        LIMITS,
        where="response.",
        max_tokens="inf",
        allow_inf=True,
        temperature=0.7,
        top_p=0.9,
        seed=5,
        stop=["\n\n"],
        instructions="Be brief.",
        store=False,
        api="realtime",
    )
    assert options.max_output_tokens == 100
    assert (options.temperature, options.top_p, options.seed) == (0.7, 0.9, 5)
    assert options.stop == ("\n\n",) and options.instructions == "Be brief."
    assert options.store is False and options.api == "realtime"
    defaults = response_options(LIMITS, api="http")
    assert defaults.max_output_tokens is None and defaults.stop == () and defaults.store
    for kwargs, param in [
        (dict(temperature=3.0), "response.temperature"),
        (dict(max_tokens=101), "response.max_output_tokens"),
        (dict(stop=["a"] * 5), "response.stop"),
        (dict(instructions="i" * 51), "response.instructions"),
    ]:
        err = refused(response_options, LIMITS, where="response.", **kwargs)
        assert err.param == param, kwargs


# ---------------------------------------------------------------- content and images


def test_check_image_bytes() -> None:
    assert check_image_bytes(png(16), LIMITS, "file") == ("PNG", 16, 16)
    for data, code in [
        (b"", "invalid_image"),
        (b"hello, not pixels", "invalid_image"),
        (png(400), "image_too_large"),
    ]:  # 160 000 pixels over 100 000
        err = refused(check_image_bytes, data, LIMITS, "file")
        assert (err.code, err.param) == (code, "file")


def text(value: str | None, param: str = "c[0].text") -> ContentPart:
    return ContentPart("text", param, text=value, type_param=param.rsplit(".", 1)[0] + ".type")


def image(url: str | None, param: str = "c[0].image_url") -> ContentPart:
    return ContentPart("image", param, url=url, type_param=param.rsplit(".", 1)[0] + ".type")


def test_parse_content_stores_parts_in_order_and_images_once() -> None:
    red, blue = png(8, (255, 0, 0)), png(8, (0, 0, 255))
    ref = "ab" * 32
    parts = [
        image(data_url(red), "c[0].image_url"),
        text("what differs?", "c[1].text"),
        image(data_url(blue), "c[2].image_url"),
        image(data_url(red), "c[3].image_url"),
        image(REF_PREFIX + ref, "c[4].image_url"),
    ]
    limits = RequestLimits(100, 50, 3, 4, 64 * 1024, 100_000)
    parsed = parse_content("user", parts, limits, param="c")
    assert [p.kind for p in parsed.parts] == ["image", "text", "image", "image", "image"]
    assert [p.digest for p in parsed.parts if p.kind == "image"] == [
        digest_of(red),
        digest_of(blue),
        digest_of(red),
        ref,
    ]
    assert parsed.parts[1].text == "what differs?"
    assert parsed.inline == {digest_of(red): red, digest_of(blue): blue}
    assert parsed.refs == {ref: "c[4].image_url"}
    assert parsed.digests == {digest_of(red), digest_of(blue), ref}


@pytest.mark.parametrize(
    ("role", "parts", "code", "param"),
    [
        ("user", [], "invalid_request", "c"),
        ("user", [text(None)], "invalid_request", "c[0].text"),
        ("user", [image(None)], "invalid_request", "c[0].image_url"),
        ("user", [image("")], "invalid_request", "c[0].image_url"),
        ("assistant", [image(data_url(png()))], "invalid_request", "c[0].type"),
        ("system", [image(data_url(png()))], "invalid_request", "c[0].type"),
        ("user", [text("x" * 51)], "input_too_large", "c[0].text"),
        ("user", [text("x")] * (2 + EXTRA_PARTS + 1), "input_too_large", "c"),
        ("user", [image(data_url(png(8, (i, 0, 0)))) for i in range(3)], "too_many_images", "c"),
        ("user", [image(data_url(b"not pixels at all"))], "invalid_image", "c[0].image_url"),
        (
            "user",
            [image("data:text/plain;base64,aGk=")],
            "unsupported_image_format",
            "c[0].image_url",
        ),
        ("user", [image("https://img.example.com/cat.jpg")], "invalid_image", "c[0].image_url"),
        ("user", [image(REF_PREFIX + "xyz")], "invalid_image", "c[0].image_url"),
        ("user", [image(data_url(png(400)))], "image_too_large", "c[0].image_url"),
    ],
)
def test_parse_content_refusals(role: str, parts: list[ContentPart], code: str, param: str) -> None:
    err = refused(parse_content, role, parts, LIMITS, param="c")
    assert (err.code, err.param) == (code, param)


def test_parse_content_takes_remote_images_only_from_fetched() -> None:
    url = "https://img.example.com/cat.png"
    data = png(12)
    parsed = parse_content("user", [image(url)], LIMITS, {url: data}, param="c")
    assert parsed.inline == {digest_of(data): data}
    err = refused(parse_content, "user", [image(url)], LIMITS, {url: b"<html>"}, param="c")
    assert err.code == "invalid_image"


async def test_fetch_remote_counts_before_fetching() -> None:
    # the allow-listed host does not exist: a fetch would fail with image_fetch_failed
    limits = RequestLimits(
        100, 50, 2, 4, 64 * 1024, 100_000, image_url_allowlist=("http://127.0.0.1:9/",)
    )
    urls = [f"http://127.0.0.1:9/{i}.png" for i in range(3)]
    with pytest.raises(GatewayError) as caught:
        await fetch_remote([image(u) for u in urls], limits, param="messages")
    assert (caught.value.code, caught.value.param) == ("too_many_images", "messages")
    # URLs off the allow-list are never fetched (parse_content then refuses them)
    off_list = [image("https://elsewhere.example.com/a.png"), image(data_url(png())), text("hi")]
    assert await fetch_remote(off_list, limits, param="messages") == {}


async def test_references_resolve_only_to_known_images() -> None:
    vision = VisionResolver(
        FakeEncoder(), make_vision_cache(None, 8 * MiB, 60), make_image_store(None, 8 * MiB, 60)
    )
    data = png(10)
    parsed = parse_content(
        "user",
        [
            image(data_url(data), "c[0].image_url"),
            image(REF_PREFIX + digest_of(data), "c[1].image_url"),
        ],
        LIMITS,
        param="c",
    )
    with pytest.raises(GatewayError) as caught:
        await resolve_references(parsed.refs, vision, owner="key_a")
    assert (caught.value.code, caught.value.param) == ("image_not_found", "c[1].image_url")
    await add_inline_images(parsed.inline, vision, owner="key_a")
    await resolve_references(parsed.refs, vision, owner="key_a")  # now held: no error
    assert await vision.known("key_a", digest_of(data))
    # held, but for the key that sent it only: another key's reference reads as unknown
    with pytest.raises(GatewayError) as caught:
        await resolve_references(parsed.refs, vision, owner="key_b")
    assert (caught.value.code, caught.value.param) == ("image_not_found", "c[1].image_url")
    assert not await vision.known("key_b", digest_of(data))
