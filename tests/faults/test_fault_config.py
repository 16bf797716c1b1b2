"""Configuration errors name the variable the user set; the OTLP timeout is in milliseconds as
the spec says; endpoints that cannot work are refused at init(); a second init() that asks for
other settings says so once."""

from __future__ import annotations

import logging

import pytest

import otel_train as ot
from otel_train.config import ConfigError
from otel_train.config_loading import load_config
from otel_train.testing import current_session


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "120000"}, ["OTEL_EXPORTER_OTLP_TIMEOUT", "milliseconds"]),
        ({"OTEL_EXPORTER_OTLP_TIMEOUT": "10"}, ["OTEL_EXPORTER_OTLP_TIMEOUT", "milliseconds", "5000"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:99999"}, ["OTEL_EXPORTER_OTLP_ENDPOINT", "1-65535"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/v1/metrics"},
         ["OTEL_EXPORTER_OTLP_ENDPOINT", "/v1/metrics", "base URL"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "ftp://collector"}, ["OTEL_EXPORTER_OTLP_ENDPOINT", "http://"]),
        ({"OTEL_EXPORTER_OTLP_HEADERS": "bad key=v"}, ["OTEL_EXPORTER_OTLP_HEADERS", "header #1"]),
    ],
)  # fmt: skip
def test_errors_name_the_otel_variable(env, fragments) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({}, environ=env)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert "OTEL_TRAIN_OTLP" not in message  # not a variable the user set


def test_otlp_timeout_variable_is_milliseconds() -> None:
    assert load_config({}, environ={"OTEL_EXPORTER_OTLP_TIMEOUT": "2500"}).otlp_timeout_s == 2.5
    assert load_config({}, environ={"OTEL_TRAIN_OTLP_TIMEOUT_S": "3"}).otlp_timeout_s == 3.0


@pytest.mark.parametrize(
    "endpoint", ["http://h:99999", "http://h:0", "https://h:4318/v1/traces", "http://h/v1/logs/"]
)
def test_unusable_endpoints_are_refused_with_the_fix(endpoint) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"otlp_endpoint": endpoint})
    assert "otlp_endpoint" in str(info.value) and "init(otlp_endpoint=...)" in str(info.value)


def test_second_init_with_other_settings_warns_once(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_train")
    first = ot.init(output_dir=str(tmp_path), prometheus_port=0, verbosity=0, log_interval=5)
    session = current_session()
    assert ot.init() == first and current_session() is session  # no settings: silently the same session
    assert ot.init(output_dir=str(tmp_path), prometheus_port=0, verbosity=0, log_interval=5) == first
    assert not [r for r in caplog.records if "init() was called again" in r.getMessage()]
    assert ot.init(log_interval=50, verbosity=0) == first
    assert ot.init(log_interval=70) == first and current_session() is session
    warnings = [r.getMessage() for r in caplog.records if "init() was called again" in r.getMessage()]
    assert len(warnings) == 1 and "log_interval" in warnings[0] and "ot.shutdown()" in warnings[0]
    assert session is not None and session.config.log_interval == 5
    ot.shutdown()


def test_second_init_with_invalid_settings_raises_as_the_first_would(tmp_path, caplog) -> None:
    """A notebook cell run again with a misspelt keyword is told, every time."""
    caplog.set_level(logging.WARNING, logger="otel_train")
    first = ot.init(output_dir=str(tmp_path), prometheus_port=0, verbosity=0)
    assert ot.init(log_interval=50) == first  # the one warning about other settings
    for _ in range(2):
        with pytest.raises(ConfigError, match="did you mean 'tensorboard'"):
            ot.init(tensorbaord=True)
        with pytest.raises(ConfigError, match="verbosity"):
            ot.init(verbosity=9)
    assert current_session() is not None and current_session().config.verbosity == 0
    ot.shutdown()
