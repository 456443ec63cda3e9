from __future__ import annotations

import pytest

from gateway.settings import Settings, SettingsError


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
