"""`--disaggregation-*` flags → `DisaggregationConfig`, and the combinations refused at start-up."""

from __future__ import annotations

import pytest

from decode_server.cli import build_parser, engine_config_from_args, main


def _config(*argv: str):
    return engine_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_defaults_are_colocated():
    cfg = _config().disaggregation
    assert cfg.mode == "null" and not cfg.enabled
    assert cfg.bootstrap_port == 8998 and cfg.transfer_backend == "mooncake" and cfg.ib_device is None
    assert cfg.bootstrap_timeout_s == 300 and cfg.waiting_timeout_s == 300


def test_prefix_caching_is_a_prefill_and_colocated_flag():
    assert _config("--disaggregation-mode", "prefill", "--enable-prefix-caching").enable_prefix_caching
    assert not _config("--disaggregation-mode", "decode", "--disable-radix-cache").enable_prefix_caching


def test_flags_map_to_the_config():
    cfg = _config("--host", "10.0.0.7", "--disaggregation-mode", "decode", "--disaggregation-bootstrap-port", "9001",
                  "--disaggregation-ib-device", "mlx5_0", "--disaggregation-bootstrap-timeout", "12",
                  "--disaggregation-waiting-timeout", "34", "--disaggregation-transfer-timeout", "7",
                  "--disaggregation-heartbeat-interval", "0.5", "--disaggregation-heartbeat-max-failures", "3"
                  ).disaggregation
    assert (cfg.mode, cfg.bootstrap_port, cfg.ib_device, cfg.host) == ("decode", 9001, "mlx5_0", "10.0.0.7")
    assert (cfg.bootstrap_timeout_s, cfg.waiting_timeout_s, cfg.transfer_timeout_s) == (12, 34, 7)
    assert (cfg.heartbeat_interval_s, cfg.heartbeat_max_failures) == (0.5, 3)


@pytest.mark.parametrize("argv, message", [
    (["--disaggregation-mode", "prefill", "--enable-hisparse"], "drop --enable-hisparse"),
    (["--disaggregation-mode", "decode", "--disaggregation-transfer-timeout", "1"], "transfer_timeout_s"),
    (["--disaggregation-mode", "decode", "--disaggregation-waiting-timeout", "0"], "waiting_timeout_s"),
    (["--disaggregation-mode", "decode", "--enable-prefix-caching"],
     "--enable-prefix-caching on a --disaggregation-mode decode server"),
])
def test_refused_combinations_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err
