"""Upstream replicas as settings name them: `URL[#model=NAME&api_key_env=VAR]`."""

from __future__ import annotations

import pytest

from gateway.cli.main import _overrides, build_parser
from gateway.engine.upstream.endpoints import parse_upstream, parse_upstreams
from gateway.settings import Settings, SettingsError


def test_a_url_with_options_from_its_fragment() -> None:
    one = parse_upstream(
        "http://gpu-1:8000/v1#model=Qwen/Qwen2.5-VL-7B&api_key_env=K1", {"K1": "sk-upstream-1"}
    )
    assert one.base_url == "http://gpu-1:8000"  # requests go to {base_url}/v1/...
    assert (one.model, one.api_key, one.name) == (
        "Qwen/Qwen2.5-VL-7B",
        "sk-upstream-1",
        "gpu-1:8000",
    )
    assert "sk-upstream" not in repr(one)  # the key never shows in a repr, hence in no log line
    plain = parse_upstream("https://llm.internal/prefix/", {})
    assert (plain.base_url, plain.model, plain.api_key) == (
        "https://llm.internal:443/prefix",
        None,
        None,
    )


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("ftp://host:1", "http(s)://"),
        ("http://user:secret@host:1", "api_key_env"),
        ("http://host:1?x=1", "query string"),
        ("http://host:1#temperature=2", "unknown option"),
        ("http://host:1#api_key_env=NOT_SET_ANYWHERE", "is not set"),
        ("http://host:1#api_key_env=1bad", "must name a variable"),
        ("http://host:99999", "bad port"),
    ],
)
def test_bad_upstreams_are_refused_with_the_reason(spec: str, problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_upstream(spec, {})
    assert problem in str(caught.value)
    assert "secret" not in str(caught.value)


def test_a_list_from_flags_or_one_comma_separated_variable() -> None:
    assert [u.name for u in parse_upstreams(["http://a:1,http://b:2", "http://c:3"], {})] == [
        "a:1",
        "b:2",
        "c:3",
    ]
    with pytest.raises(ValueError, match="twice"):
        parse_upstreams(["http://a:1", "http://a:1/v1"], {})
    with pytest.raises(ValueError, match="at least one"):
        parse_upstreams([" , "], {})


def test_settings_and_flags_for_the_openai_engine() -> None:
    args = build_parser().parse_args(
        ["serve", "--engine", "openai", "--upstream", "http://a:1", "--upstream", "http://b:2"]
    )
    settings = Settings.load(_overrides(args), environ={})
    assert settings.engine == "openai" and settings.upstreams == ["http://a:1", "http://b:2"]
    env = Settings.load(
        environ={"VISIONGATE_ENGINE": "openai", "VISIONGATE_UPSTREAMS": "http://a:1,http://b:2"}
    )
    assert [u.name for u in parse_upstreams(env.upstreams, {})] == ["a:1", "b:2"]
    with pytest.raises(SettingsError, match="VISIONGATE_UPSTREAMS: at least one"):
        Settings.load({"engine": "openai"}, environ={})
    with pytest.raises(SettingsError, match="VISIONGATE_ENGINE"):
        Settings.load({"engine": "vllm"}, environ={})
    with pytest.raises(SettingsError, match="VISIONGATE_UPSTREAM_IMAGES: embeds needs"):
        Settings.load(
            {"engine": "openai", "upstreams": ["http://a:1"], "upstream_images": "embeds"},
            environ={},
        )
