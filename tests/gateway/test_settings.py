from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gateway.cli.main import _overrides, build_parser
from gateway.settings import Range, Settings, SettingsError, declarations

ROOT = Path(__file__).resolve().parents[2]


def test_environment_overrides_defaults_and_flags_override_environment() -> None:
    env = {"VISIONGATE_PORT": "9100", "VISIONGATE_API_KEYS": "k1, k2", "VISIONGATE_REDIS_URL": ""}
    s = Settings.load({"port": 9200}, environ=env)
    assert s.port == 9200 and s.api_keys == ["k1", "k2"] and s.redis_url is None
    assert Settings.load(environ=env).port == 9100


@pytest.mark.parametrize(
    "env, fragment",
    [
        ({"VISIONGATE_PORT": "eighty"}, "VISIONGATE_PORT"),
        ({"VISIONGATE_PORT": "70000"}, "VISIONGATE_PORT"),
        ({"VISIONGATE_PRUNING": "most"}, "VISIONGATE_PRUNING"),
        ({"VISIONGATE_REDIS_URL": "http://x"}, "VISIONGATE_REDIS_URL"),
        ({"VISIONGATE_MAX_OUTPUT_TOKENS": "0"}, "VISIONGATE_MAX_OUTPUT_TOKENS"),
        ({"VISIONGATE_TYPO": "1"}, "unknown setting"),
        ({"VISIONGATE_MODEL_PATH": "/no/such/dir"}, "VISIONGATE_MODEL_PATH"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(SettingsError) as err:
        Settings.load(environ=env)
    assert fragment in str(err.value)


def test_ws_frame_limit_leaves_room_for_an_oversized_image_error() -> None:
    s = Settings.load({"max_image_bytes": 2 * 1024 * 1024}, environ={})
    assert s.ws_max_frame_bytes > s.max_image_bytes * 4 // 3


def test_variables_of_other_parts_are_not_refused_as_unknown_settings() -> None:
    # VISIONGATE_KERNELS is read by kernels/ in any process (docs/configuration.md documents it)
    settings = Settings.load(environ={"VISIONGATE_KERNELS": "torch", "VISIONGATE_PORT": "9001"})
    assert settings.port == 9001
    with pytest.raises(SettingsError, match="VISIONGATE_KERNEL: unknown setting"):
        Settings.load(environ={"VISIONGATE_KERNEL": "torch"})


def test_encoder_deployment_is_a_name_that_can_enter_redis_keys() -> None:
    assert Settings.load(environ={"VISIONGATE_ENCODER_DEPLOYMENT": "blue-2"}).encoder_deployment
    with pytest.raises(SettingsError, match="VISIONGATE_ENCODER_DEPLOYMENT"):
        Settings.load(environ={"VISIONGATE_ENCODER_DEPLOYMENT": "a:b"})


def _serve_flags() -> dict[str, argparse.Action]:
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in subcommands.choices["serve"]._actions if a.option_strings}


def _as_variable(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return ",".join(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_setting_has_a_variable_a_flag_or_why_none_and_a_row_on_the_page() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    flags = _serve_flags()
    for setting in declarations():
        # the variable is read: its default, written as a variable, loads back as the default
        loaded = Settings.load(environ={setting.env: _as_variable(setting.default)})
        assert getattr(loaded, setting.name) == setting.default, setting.env
        if setting.flag is not None:
            assert setting.flag_name in flags[setting.name].option_strings, setting.name
            assert flags[setting.name].default is None  # a flag not given keeps the variable
            assert "{" not in flags[setting.name].help  # the declared default is filled in
        else:
            assert setting.no_flag is not None and setting.no_flag.why.strip(), setting.name
            assert setting.name not in flags
        assert f"| `{setting.env}` |" in page, setting.env
        assert setting.doc.text.strip(), setting.name


def _outside(bounds: Range) -> float:
    if bounds.ge is not None:
        return bounds.ge - (1 if float(bounds.ge).is_integer() else 0.01)
    if bounds.gt is not None:
        return bounds.gt
    assert bounds.le is not None
    return bounds.le + 1


@pytest.mark.parametrize("setting", [s for s in declarations() if s.range], ids=lambda s: s.name)
def test_a_value_out_of_its_declared_range_is_refused_naming_the_variable(setting) -> None:
    value = _outside(setting.range)
    if setting.value_type is int:
        value = int(value)
    with pytest.raises(SettingsError) as err:
        Settings.load(environ={setting.env: str(value)})
    assert str(err.value).startswith(f"{setting.env}: must be ")
    assert float(str(err.value).rsplit(", got ", 1)[1]) == value
    with pytest.raises(SettingsError, match=setting.env):
        Settings(**{setting.name: value})


@pytest.mark.parametrize("setting", [s for s in declarations() if s.choices], ids=lambda s: s.name)
def test_a_value_not_among_its_choices_is_refused_naming_the_variable_and_the_choices(
    setting,
) -> None:
    expected = f"{setting.env}: must be {', '.join(setting.choices[:-1])} or "
    for refuse in (
        lambda: Settings.load(environ={setting.env: "no-such-choice"}),
        lambda: Settings.load({setting.name: "no-such-choice"}, environ={}),
        lambda: Settings(**{setting.name: "no-such-choice"}),
    ):
        with pytest.raises(SettingsError) as err:
            refuse()
        assert str(err.value).startswith(expected)
        assert str(err.value).endswith(f"{setting.choices[-1]}, got 'no-such-choice'")


def test_ranges_read_as_they_are_refused() -> None:
    assert Range(ge=1, le=65535).text() == "1..65535"
    assert Range(ge=1024, le=512 * 1024 * 1024).text("bytes") == "1 KiB..512 MiB"
    assert Range(gt=0, le=3600).text("seconds") == "in (0, 3600] seconds"
    assert Range(ge=1).text("seconds") == ">= 1 second"
    assert Range(ge=0, note="0: no cap").text() == ">= 0 (0: no cap)"
    assert Range(ge=0, note="0: no cap").text(note=False) == ">= 0"
    assert not Range(ge=0.05, le=120).holds(float("nan"))


def test_the_serve_flags_reach_the_settings() -> None:
    argv = "serve --port 9001 --no-prefix-caching --engine openai --pruning topk"
    args = build_parser().parse_args(
        [*argv.split(), "--upstream", "http://a:1", "--upstream", "http://b:2"]
    )
    env = {"VISIONGATE_PORT": "9100", "VISIONGATE_PRUNING": "none", "VISIONGATE_DEVICE": "cpu"}
    settings = Settings.load(_overrides(args), environ=env)
    assert (settings.port, settings.prefix_caching, settings.pruning) == (9001, False, "topk")
    assert settings.upstreams == ["http://a:1", "http://b:2"] and settings.device == "cpu"
    help = {a.dest: a.help for a in _serve_flags().values()}
    assert help["port"] == "port (default 8000)" and help["prefix_caching"].endswith("(default on)")
    with pytest.raises(SystemExit):  # argparse refuses a flag's value of the wrong type
        build_parser().parse_args(["serve", "--engine-max-batch", "many"])
    with pytest.raises(SettingsError, match="VISIONGATE_ENGINE_MAX_BATCH: must be 1..1024"):
        Settings.load(_overrides(build_parser().parse_args(["serve", "--engine-max-batch", "0"])))


def test_convert_keeps_its_models_where_the_flag_or_else_the_variable_says(monkeypatch) -> None:
    from gateway.cli.main import _load_settings

    monkeypatch.setenv("VISIONGATE_CACHE_DIR", "/from/the/variable")
    convert = build_parser().parse_args(["convert"])
    assert _load_settings(convert).cache_dir == "/from/the/variable"
    convert = build_parser().parse_args(["convert", "--cache-dir", "/from/the/flag"])
    assert _load_settings(convert).cache_dir == "/from/the/flag"
