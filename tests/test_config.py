"""Config precedence (kwargs > env > file > defaults) and error messages that name the fix."""

from __future__ import annotations

import re

import pytest

from otel_train.config import Config, ConfigError, config_as_dict
from otel_train.config_loading import load_config


def test_defaults() -> None:
    config = load_config({}, environ={})
    assert config == Config()
    assert config.prometheus_port == 9464
    assert config.otlp_protocol == "http/protobuf"


def test_precedence_kwargs_over_env_over_file(tmp_path) -> None:
    path = tmp_path / "ot.yaml"
    path.write_text("log_interval: 7\nverbosity: 2\ntrace_every: 50\nservice_name: from-file\n")
    env = {"OTEL_TRAIN_LOG_INTERVAL": "9", "OTEL_SERVICE_NAME": "from-env", "OTEL_TRAIN_CONFIG": str(path)}
    config = load_config({"log_interval": 11}, environ=env)
    assert config.log_interval == 11  # kwargs
    assert config.service_name == "from-env"  # env over file
    assert config.verbosity == 2 and config.trace_every == 50  # file over defaults


def test_standard_otel_variables() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer%20abc,x-tenant=t1",
        "OTEL_RESOURCE_ATTRIBUTES": "team=ml,cluster=c1",
        "OTEL_METRIC_EXPORT_INTERVAL": "15000",
    }
    config = load_config({}, environ=env)
    assert config.otlp_endpoint == "http://collector:4318"
    assert config.otlp_protocol == "grpc"
    assert config.otlp_headers == {"authorization": "Bearer abc", "x-tenant": "t1"}
    assert config.resource_attributes == {"team": "ml", "cluster": "c1"}
    assert config.metric_export_interval_s == 15.0


@pytest.mark.parametrize(
    ("overrides", "env", "fragments"),
    [
        ({"log_interval": 0}, {}, ["log_interval", "0", ">= 1", "OTEL_TRAIN_LOG_INTERVAL"]),
        (
            {},
            {"OTEL_TRAIN_LOG_INTERVAL": "ten"},
            ["log_interval", "OTEL_TRAIN_LOG_INTERVAL", "'ten'", "integer"],
        ),
        ({"otlp_protocol": "udp"}, {}, ["otlp_protocol", "'udp'", "'grpc'"]),
        ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, ["otlp_endpoint", "http://localhost:4318"]),
        (
            {},
            {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "vm:8428/opentelemetry/v1/metrics"},
            ["otlp_metrics_endpoint", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "/opentelemetry/v1/metrics"],
        ),
        ({"prometheus_port": 70000}, {}, ["prometheus_port", "70000", "0 to disable"]),
        (
            {"prometheus_port": None},
            {},
            ["prometheus_port", "None", "integer", "0 turns the pull endpoint off"],
        ),
        ({"timing_log_level": 3}, {}, ["timing_log_level", "0, 1 or 2"]),
        ({}, {"OTEL_TRAIN_EXCHANGE_FANIN": "1"}, ["exchange_fanin", "OTEL_TRAIN_EXCHANGE_FANIN", ">= 2"]),
        ({"bogus": 1}, {}, ["unknown setting", "'bogus'"]),
        ({}, {"OTEL_METRIC_EXPORT_INTERVAL": "soon"}, ["OTEL_METRIC_EXPORT_INTERVAL", "milliseconds"]),
        ({"run_name": "bad name/.."}, {}, ["run_name", "letters, digits"]),
        (
            {},
            {"OTEL_TRAIN_COMPUTE_DTYPE": "int8"},
            ["compute_dtype", "OTEL_TRAIN_COMPUTE_DTYPE", "'int8'", "'fp8'"],
        ),
    ],
)
def test_invalid_settings_name_setting_value_and_fix(overrides, env, fragments) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides, environ=env)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bad_yaml_file(tmp_path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("log_interval: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config({}, environ={}, config_file=str(path))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config({}, environ={}, config_file=str(tmp_path / "missing.yaml"))
    path.write_text("nonsense_key: 1\n")
    with pytest.raises(ConfigError, match="unknown settings"):
        load_config({}, environ={}, config_file=str(path))


def test_secret_header_never_echoed_in_errors_or_dict() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({}, environ={"OTEL_EXPORTER_OTLP_HEADERS": "authorization=SECRET-MARKER,broken"})
    assert "SECRET-MARKER" not in str(info.value)
    config = load_config({"otlp_headers": {"authorization": "SECRET-MARKER"}}, environ={})
    assert "SECRET-MARKER" not in repr(config_as_dict(config))


def test_file_values_are_read_by_their_declared_type(tmp_path) -> None:
    """A YAML file's values take their field's type: a list as a tuple, an int as a float, "off"
    as False, "null" as unset; a value of another type is refused naming the file."""
    path = tmp_path / "ot.yaml"
    path.write_text("wandb_tags: [a, 7]\notlp_timeout_s: 3\nhardware: 'off'\ntotal_steps: null\n")
    config = load_config({}, environ={}, config_file=str(path))
    assert config.wandb_tags == ("a", "7") and config.otlp_timeout_s == 3.0
    assert (
        isinstance(config.otlp_timeout_s, float) and config.hardware is False and config.total_steps is None
    )
    path.write_text("queue_size: 2.5\n")
    with pytest.raises(
        ConfigError,
        match=rf"queue_size = 2\.5 is invalid: use an integer >= 1 \(from {re.escape(str(path))}:queue_size",
    ):
        load_config({}, environ={}, config_file=str(path))


def test_header_rules_apply_to_the_headers_setting_only(tmp_path) -> None:
    # A file named after headers holds resource attributes, whose keys may have spaces; the
    # header-name rule applies to `otlp_headers`, however its value is given.
    path = tmp_path / "headers.yaml"
    path.write_text('resource_attributes: "team name=ml"\n')
    assert load_config({}, environ={}, config_file=str(path)).resource_attributes == {"team name": "ml"}
    path.write_text('otlp_headers: "bad key=v"\n')
    with pytest.raises(ConfigError, match="header #1"):
        load_config({}, environ={}, config_file=str(path))
    with pytest.raises(ConfigError, match="header #1"):
        load_config({"otlp_headers": {"bad key": "v"}}, environ={})


def test_a_header_error_never_shows_the_credential() -> None:
    # `:` for `=` makes the whole `Authorization: Basic <token>` the header's name; base64's `=`
    # padding then splits it into a "name" and a "value"
    secret = "dXNlcjpTRUNSRVRfQkFTSUM"
    with pytest.raises(ConfigError, match=r"starts 'Authorization'.*name=value") as raised:
        load_config({}, environ={"OTEL_EXPORTER_OTLP_HEADERS": f"Authorization: Basic {secret}="})
    assert secret[:8] not in str(raised.value)
    with pytest.raises(ConfigError, match="otlp_headers") as raised:  # a list, not a mapping
        load_config({"otlp_headers": [f"authorization=Bearer {secret}"]}, environ={})
    assert secret[:8] not in str(raised.value)


@pytest.mark.parametrize("name", ["²", "٣"])
def test_a_signal_number_in_other_digits_is_refused_with_the_fix(name: str) -> None:
    # str.isdigit() takes both; int() refuses "²": the setting must fail as a ConfigError naming it
    with pytest.raises(ConfigError, match="stack_dump_signal"):
        load_config({"stack_dump_signal": name}, environ={})


@pytest.mark.parametrize(
    "name",
    ["log_interval_min_s", "stall_timeout_s", "hardware_interval_s", "checkpoint_timeout_s", "peak_flops"],
)
@pytest.mark.parametrize("text", ["inf", "nan", "-inf", "1e400"])
def test_a_float_setting_must_be_finite(name: str, text: str) -> None:
    # inf passed `> 0` and then overflowed an int conversion in the step, at init, or in a thread
    env_key = f"OTEL_TRAIN_{name.upper()}"
    with pytest.raises(ConfigError, match=rf"setting {name} = .* it must be a finite number.*{env_key}"):
        load_config({}, environ={env_key: text})
    with pytest.raises(ConfigError, match=rf"setting {name} = .* it must be a finite number"):
        load_config({name: float(text)}, environ={})


def test_stall_timeout_s_inf_names_how_to_hear_of_long_gaps_only() -> None:
    with pytest.raises(ConfigError, match=r"no off switch.*86400"):
        load_config({"stall_timeout_s": float("inf")}, environ={})


def test_log_interval_s_inf_means_never_by_time() -> None:
    assert load_config({}, environ={"OTEL_TRAIN_LOG_INTERVAL_S": "inf"}).log_interval_s == float("inf")
    with pytest.raises(ConfigError, match=r"or inf \(never by time\)"):
        load_config({"log_interval_s": -1.0}, environ={})


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"samples_to_show": -3}, ["samples_to_show", "-3", "an integer >= 0"]),
        ({"samples_to_show": 0}, None),
        ({"flops_per_token": -6e9}, ["flops_per_token", "a number > 0"]),
        ({"flops_per_token": 0.0}, ["flops_per_token", "a number > 0"]),
        ({"flops_per_token": 6e9}, None),
    ],
)
def test_sample_count_and_flops_per_token_have_ranges(overrides, fragments) -> None:
    if fragments is None:
        load_config(overrides, environ={})
        return
    with pytest.raises(ConfigError) as info:
        load_config(overrides, environ={})
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        (
            {"OTEL_METRIC_EXPORT_INTERVAL": "-5"},
            [
                "OTEL_METRIC_EXPORT_INTERVAL='-5'",
                "milliseconds > 0",
                "e.g. 10000",
                "metric_export_interval_s",
            ],
        ),
        ({"OTEL_METRIC_EXPORT_INTERVAL": "inf"}, ["OTEL_METRIC_EXPORT_INTERVAL='inf'", "finite"]),
        (
            {"OTEL_EXPORTER_OTLP_TIMEOUT": "70000"},
            ["OTEL_EXPORTER_OTLP_TIMEOUT='70000'", "milliseconds in (0, 60000]"],
        ),
    ],
)
def test_a_standard_variable_in_milliseconds_is_refused_as_written(env, fragments) -> None:
    """The error shows the milliseconds the user wrote and the range in milliseconds, not the
    seconds they became (-5 ms is not "-0.005")."""
    with pytest.raises(ConfigError) as info:
        load_config({}, environ=env)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "-0.005" not in message and "70.0" not in message


def test_an_unknown_setting_names_the_closest_one(tmp_path) -> None:
    with pytest.raises(ConfigError, match="unknown setting 'tensorbaord': did you mean 'tensorboard'"):
        load_config({"tensorbaord": True}, environ={})
    path = tmp_path / "ot.yaml"
    path.write_text("tensorbaord: true\nrun_nme: x\n")
    with pytest.raises(ConfigError) as info:
        load_config({}, environ={}, config_file=str(path))
    message = str(info.value)
    assert "did you mean 'tensorboard' for 'tensorbaord'?" in message, message
    assert "did you mean 'run_name' for 'run_nme'?" in message, message


def test_http_json_names_the_sdk_gap_and_the_variable_that_keeps_it_for_other_tools() -> None:
    """OTEL_EXPORTER_OTLP_PROTOCOL=http/json is valid OpenTelemetry, set for other tools too."""
    with pytest.raises(ConfigError, match="no http/json exporter; set OTEL_TRAIN_OTLP_PROTOCOL"):
        load_config({}, environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    both = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_TRAIN_OTLP_PROTOCOL": "http/protobuf"}
    assert load_config({}, environ=both).otlp_protocol == "http/protobuf"


def test_a_misspelt_otel_train_variable_is_named_once_with_the_closest_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import otel_train as ot
    from otel_train import config_loading

    monkeypatch.setattr(config_loading, "_warned_env", set(), raising=False)
    monkeypatch.setenv("OTEL_TRAIN_SERVICE_NAMe", "mine")
    monkeypatch.setenv("OTEL_TRAIN_EXPORT_INTERVAL", "5000")
    monkeypatch.setenv("OTEL_TRAIN_ZZQQ", "1")
    for name in ("OTEL_TRAIN_CONFIG", "OTEL_TRAIN_LIGHTNING", "OTEL_TRAIN_TOOLS", "OTEL_TRAIN_VERBOSITY"):
        monkeypatch.setenv(name, "0" if name == "OTEL_TRAIN_VERBOSITY" else "")
    run = ot.init(prometheus_port=0, hardware=False, run_dir_enabled=False)  # a warning, not an error
    load_config()  # a second look at the same variables: no second warning
    ot.shutdown()
    assert run is not None
    warned = sorted(r.getMessage() for r in caplog.records if "is no otel_train setting" in r.getMessage())
    assert len(warned) == 3, warned
    assert "OTEL_TRAIN_EXPORT_INTERVAL is no otel_train setting" in warned[0]
    assert "did you mean 'OTEL_METRIC_EXPORT_INTERVAL'?" in warned[0]
    assert "OTEL_TRAIN_SERVICE_NAMe" in warned[1] and "did you mean 'OTEL_TRAIN_SERVICE_NAME'?" in warned[1]
    assert "OTEL_TRAIN_ZZQQ" in warned[2] and "did you mean" not in warned[2]


def test_every_otel_train_variable_the_package_reads_is_a_setting_or_a_known_switch() -> None:
    """A variable the library reads that is no setting must be in NOT_SETTINGS_ENV, or init() would
    warn about it."""
    from pathlib import Path

    import otel_train
    from otel_train.config import declared, env_name
    from otel_train.config_loading import NOT_SETTINGS_ENV

    package = Path(otel_train.__file__).parent
    named = {
        m for p in package.rglob("*.py") for m in re.findall(r"OTEL_TRAIN_[A-Z0-9_]*[A-Z0-9]", p.read_text())
    }
    assert named - {env_name(name) for name in declared()} - NOT_SETTINGS_ENV == set()
    assert "OTEL_TRAIN_LIGHTNING" in named  # integrations.lightning.ENV_SWITCH


def test_a_keyword_wins_over_a_malformed_variable_it_overrides() -> None:
    """Only the value in force is read: a malformed standard variable under a keyword or under
    its OTEL_TRAIN_ variable stops nothing."""
    bad = {"OTEL_EXPORTER_OTLP_TIMEOUT": "abc", "OTEL_METRIC_EXPORT_INTERVAL": "5"}
    config = load_config({"otlp_timeout_s": 7.0, "metric_export_interval_s": 5.0}, environ=bad)
    assert (config.otlp_timeout_s, config.metric_export_interval_s) == (7.0, 5.0)
    assert (
        load_config(
            {},
            environ={**bad, "OTEL_TRAIN_OTLP_TIMEOUT_S": "7", **{"OTEL_TRAIN_METRIC_EXPORT_INTERVAL_S": "5"}},
        ).otlp_timeout_s
        == 7.0
    )
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_TIMEOUT='abc'"):
        load_config({}, environ=bad)


@pytest.mark.parametrize("key", ["OTEL_METRIC_EXPORT_INTERVAL", "OTEL_EXPORTER_OTLP_TIMEOUT"])
def test_seconds_written_in_a_milliseconds_variable_are_refused(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"{key}='60' is in milliseconds .* surely meant as seconds"):
        load_config({}, environ={key: "60"})


def test_config_file_must_be_a_path(tmp_path) -> None:
    """`ot.init(3)` would open file descriptor 3 as the config file, and close it."""
    for given in (3, True, 0, ["a.yaml"]):
        with pytest.raises(TypeError, match="needs the path of a YAML file; settings are keyword arguments"):
            load_config({}, environ={}, config_file=given)  # type: ignore[arg-type]
    path = tmp_path / "ot.yaml"
    path.write_text("log_interval: 3\n")
    assert load_config({}, environ={}, config_file=path).log_interval == 3  # type: ignore[arg-type]


def test_an_unreadable_config_file_is_a_config_error(tmp_path) -> None:
    binary = tmp_path / "ot.yaml"
    binary.write_bytes(b"run_name: \xff\xfe\n")
    for path in (tmp_path, binary):
        with pytest.raises(ConfigError, match="cannot be read as a UTF-8 YAML file"):
            load_config({}, environ={"OTEL_TRAIN_CONFIG": str(path)})


@pytest.mark.parametrize("value", ["off", "OFF", "none", " off "])
def test_stack_dump_signal_off_from_the_environment(value: str) -> None:
    """An empty variable means unset (the OpenTelemetry convention), so `off` turns dumps off."""
    from otel_train.config import signal_number

    config = load_config({}, environ={"OTEL_TRAIN_STACK_DUMP_SIGNAL": value})
    assert signal_number(config.stack_dump_signal) is None
    assert load_config({}, environ={"OTEL_TRAIN_STACK_DUMP_SIGNAL": ""}).stack_dump_signal == "SIGUSR1"


def test_yaml_values_that_are_not_text_are_refused_with_quote_it(tmp_path) -> None:
    path = tmp_path / "ot.yaml"
    for line in ("stack_dump_signal: off", "run_name: 2024-01-01", "run_name: 42", "otlp_protocol: no"):
        path.write_text(line + "\n")
        with pytest.raises(ConfigError, match="in a YAML file, quote it"):
            load_config({}, environ={}, config_file=str(path))
    path.write_text("run_name: '42'\nstack_dump_signal: 'off'\n")
    assert load_config({}, environ={}, config_file=str(path)).run_name == "42"


def test_text_settings_are_read_as_the_environment_reads_them() -> None:
    import numpy as np

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": " http://x:4318 ", "OTEL_TRAIN_OTLP_PROTOCOL": "GRPC "}
    config = load_config({"total_steps": np.int64(5), "log_interval_s": np.int32(2)}, environ=env)
    assert (config.otlp_endpoint, config.otlp_protocol) == ("http://x:4318", "grpc")
    assert config.total_steps == 5 and type(config.total_steps) is int
    assert config.log_interval_s == 2.0 and type(config.log_interval_s) is float
