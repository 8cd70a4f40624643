"""Unit tests without a server: error mapping, SSE, metrics, CLI, the engine client's death reason (the message
codec and the engine loop: tests/runtime/test_runtime_units.py)."""

from __future__ import annotations

import json

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from decode_server.api.errors import validation_error_response
from decode_server.api.metrics import ServerMetrics, ThroughputWindow
from decode_server.api.sse import DONE_FRAME, parse_sse, sse_frame
from decode_server.cli import (
    build_parser,
    engine_config_from_args,
    main,
    parse_bytes,
    server_config_from_args,
)
from decode_server.engine.types import EngineStats, HiSparseLayerStats, PoolUsage
from decode_server.runtime.messages import FatalMsg, encode

# ------------------------------------------------------------------------------------------------ HTTP edge


def test_validation_errors_become_400_with_param() -> None:
    r = validation_error_response(
        [{"type": "greater_than_equal", "loc": ("body", "max_tokens"), "msg": "Input should be >= 1"}]
    )
    body = json.loads(r.body)
    assert r.status_code == 400
    assert body == {"error": {"message": "invalid value for 'max_tokens': Input should be >= 1",
                              "type": "invalid_request_error", "param": "max_tokens", "code": 400}}  # fmt: skip
    r = validation_error_response([{"type": "missing", "loc": ("body", "messages"), "msg": "Field required"}])
    assert json.loads(r.body)["error"]["message"] == "missing required parameter 'messages'"
    r = validation_error_response(
        [{"type": "json_invalid", "loc": ("body", 3), "msg": "x", "ctx": {"error": "bad"}}]
    )
    assert r.status_code == 400 and "not valid JSON" in json.loads(r.body)["error"]["message"]
    union = [{"type": "string_type", "loc": ("body", "messages", 0, "content", "str"), "msg": "bad"}]
    assert json.loads(validation_error_response(union).body)["error"]["param"] == "messages.0.content"


def test_sse_frames() -> None:
    frame = sse_frame({"a": "line1\nline2", "b": "ü"})
    assert frame.startswith("data: ") and frame.endswith("\n\n") and frame.count("\n") == 2
    assert parse_sse(frame + DONE_FRAME) == ['{"a":"line1\\nline2","b":"ü"}', "[DONE]"]


# ------------------------------------------------------------------------------------------------ metrics


def test_throughput_window() -> None:
    w = ThroughputWindow(window_s=10.0)
    w.add(50, now=100.0)
    w.add(50, now=105.0)
    assert w.rate(now=106.0) == pytest.approx(10.0)
    assert w.rate(now=112.0) == pytest.approx(5.0)  # the first batch left the window
    assert w.rate(now=200.0) == 0.0


def test_throughput_window_stays_bounded_when_nobody_reads_it() -> None:
    """A server that is never scraped adds token batches for days: the window keeps only its last seconds."""
    w = ThroughputWindow(window_s=10.0)
    for i in range(100_000):
        w.add(1, now=i * 0.01)  # 1000 s of traffic, 100 batches a second
    assert len(w) <= 10.0 / 0.01 + 1
    assert w.rate(now=1000.0) == pytest.approx(100.0, rel=0.02)


def test_metrics_render_engine_stats_and_latencies() -> None:
    m = ServerMetrics("tiny-dsa")
    m.latest_stats = EngineStats(
        num_running_reqs=3, num_queue_reqs=2, token_usage=0.25, num_generated_tokens=40, num_prompt_tokens=90,
        hisparse_enabled=True, host_pages=PoolUsage(used=2, total=8),
        hisparse_layers=[HiSparseLayerStats(layer=0, hits=30, misses=10, bytes_h2d=1000, bytes_d2h=10),
                         HiSparseLayerStats(layer=1, hits=10, misses=10, speculative_rows_saved=-3)],
    )  # fmt: skip
    m.on_first_token(0.2)
    m.on_tokens(1, None)
    m.on_tokens(2, 0.1)
    m.on_finished("length", 0.5)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}  # fmt: skip
    lbl = (("model_name", "tiny-dsa"),)
    assert samples[("sglang:num_running_reqs", lbl)] == 3
    assert samples[("sglang:num_queue_reqs", lbl)] == 2
    assert samples[("sglang:token_usage", lbl)] == 0.25
    assert samples[("sglang:generation_tokens_total", lbl)] == 40
    assert samples[("sglang:prompt_tokens_total", lbl)] == 90
    assert samples[("sglang:time_to_first_token_seconds_count", lbl)] == 1
    assert samples[("sglang:inter_token_latency_seconds_count", lbl)] == 2  # two tokens, 0.05 s each
    assert samples[("sglang:inter_token_latency_seconds_sum", lbl)] == pytest.approx(0.1)
    assert samples[("sglang:e2e_request_latency_seconds_count", lbl)] == 1
    assert (
        samples[("sglang:num_requests_total", (("finish_reason", "length"), ("model_name", "tiny-dsa")))] == 1
    )
    layer0 = (("layer", "0"), ("model_name", "tiny-dsa"))
    assert samples[("hisparse:swap_in_hits_total", layer0)] == 30
    assert samples[("hisparse:swap_in_misses_total", layer0)] == 10
    assert samples[("hisparse:bytes_h2d_total", layer0)] == 1000
    assert samples[("hisparse:hit_rate", lbl)] == pytest.approx(40 / 60)
    # the bets' payoff: a gauge (it can fall), only for the layers that have a counterfactual
    assert samples[("hisparse:speculative_prefetch_rows_saved", (("layer", "1"), ("model_name", "tiny-dsa")))] == -3
    assert ("hisparse:speculative_prefetch_rows_saved", layer0) not in samples
    assert samples[("hisparse:host_pool_usage", lbl)] == 0.25
    assert samples[("sglang:gen_throughput", lbl)] > 0


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_flags_map_to_configs() -> None:
    args = build_parser().parse_args([
        "serve", "--model-path", "/m", "--enable-hisparse", "--hisparse-config", '{"top_k": 8, "device_buffer_size": 16}',
        "--kv-cache-dtype", "bfloat16", "--device", "cpu", "--mem-fraction-static", "0.5",
        "--max-running-requests", "7", "--chunked-prefill-size", "512", "--host-kv-budget", "2GiB",
        "--api-key", "k", "--served-model-name", "m", "--port", "1234", "--enable-priority-scheduling",
        "--schedule-low-priority-values-first", "--log-requests", "--log-requests-level", "3",
    ])  # fmt: skip
    cfg = engine_config_from_args(args)
    assert cfg.enable_priority_scheduling and cfg.schedule_low_priority_values_first
    assert not cfg.abort_on_priority_when_disabled
    server = server_config_from_args(args)
    assert server.log_requests and server.log_requests_level == 3
    assert cfg.model_path == "/m" and cfg.enable_hisparse and cfg.hisparse.top_k == 8
    assert cfg.hisparse.device_buffer_size == 16 and cfg.kv_cache_dtype == "bfloat16" and cfg.device == "cpu"
    assert (
        cfg.mem_fraction_static == 0.5 and cfg.max_running_requests == 7 and cfg.chunked_prefill_size == 512
    )
    assert cfg.host_kv_budget_bytes == 2 * 2**30
    assert (args.api_key, args.served_model_name, args.port) == ("k", "m", 1234)


@pytest.mark.parametrize(("text", "expected"), [("1024", 1024), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                                 ("2gib", 2 * 2**30), ("4k", 4000)])  # fmt: skip
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", [
    ["--hisparse-config", "{not json"],
    ["--hisparse-config", '{"top_k": 64, "device_buffer_size": 8}'],
    ["--hisparse-config", '{"unknown_key": 1}'],
    ["--mem-fraction-static", "1.5"],
    ["--max-running-requests", "0"],
    ["--port", "70000"],
])  # fmt: skip
def test_cli_rejects_bad_flags(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", *bad])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_generate_offline(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--model-path", "tiny-dsa", "--device", "cpu", "--context-length", "128",
                 "--prompt", "Hello", "--prompt", "World", "--max-tokens", "3", "--ignore-eos", "--json"])  # fmt: skip
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [x["prompt"] for x in lines] == ["Hello", "World"]
    assert all(len(x["token_ids"]) == 3 and x["finish_reason"] == "length" for x in lines)
    code = main(["generate", "--model-path", "tiny-dsa", "--device", "cpu", "--context-length", "128",
                 "--prompt", "Hello", "--max-tokens", "4", "--logit-bias", "77=100", "--frequency-penalty", "0.5",
                 "--min-tokens", "2", "--json"])  # fmt: skip
    assert code == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == [77] * 4


def test_cli_generate_structured(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    pytest.importorskip("xgrammar")
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], '
                      '"additionalProperties": false}')
    base = ["generate", "--model-path", "tiny-dsa", "--device", "cpu", "--context-length", "128", "--prompt", "Hi",
            "--max-tokens", "40", "--json", "--constrained-json-disable-any-whitespace"]  # fmt: skip
    assert main([*base, "--json-schema", f"@{schema}"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop" and json.loads(out["text"]) in ({"ok": True}, {"ok": False})
    assert main([*base, "--regex", "(yes|no)!"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes!", "no!")
    assert main([*base, "--regex", "(unclosed"]) == 2
    assert "invalid regex" in capsys.readouterr().err


class _ExitedProcess:
    """A child process that has already exited with code 1 (what the watchdog finds after an engine crash)."""

    pid = 12345
    exitcode = 1

    def is_alive(self) -> bool:
        return False


def test_engine_death_reason_arriving_after_the_exit_is_kept() -> None:
    """The engine sends why it dies (FatalMsg) just before it exits; when the watchdog sees the exit first, the
    reason that arrives right after still names the death (not a bare "exit code 1")."""
    import asyncio

    from decode_server.api.engine_client import EngineClient
    from decode_server.config import EngineConfig

    async def scenario() -> tuple[str, bool]:
        client = EngineClient(EngineConfig(device="cpu"))
        client._process = _ExitedProcess()  # type: ignore[assignment]
        receiver = asyncio.create_task(client._receive_loop())
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(client.from_engine_addr)

        async def late_reason() -> None:
            await asyncio.sleep(0.1)  # after the watchdog's first look at the process
            push.send(encode(FatalMsg("tensor-parallel rank 1 (pid 7) died (signal SIGKILL)")))

        sender = asyncio.create_task(late_reason())
        await client._watchdog()
        await sender
        receiver.cancel()
        push.close()
        client.close_sockets()
        return client.death_reason, client.dead

    reason, dead = asyncio.run(scenario())
    assert dead
    assert reason == "tensor-parallel rank 1 (pid 7) died (signal SIGKILL)"


def test_engine_death_reason_lost_with_the_process_is_read_from_its_note() -> None:
    """Rank 0's supervisor ends the process with os._exit once a rank has died, and a FatalMsg still queued then is
    lost; the reason it wrote to the death note beside the sockets first still names the death, without waiting
    out the grace for a message that will not come."""
    import asyncio
    import time

    from decode_server.api.engine_client import DEATH_REASON_GRACE_S, EngineClient
    from decode_server.config import EngineConfig
    from decode_server.runtime.death_note import write_note

    async def scenario() -> tuple[str, bool, float]:
        client = EngineClient(EngineConfig(device="cpu"))
        client._process = _ExitedProcess()  # type: ignore[assignment]
        receiver = asyncio.create_task(client._receive_loop())
        try:
            write_note(client.from_engine_addr, "tensor-parallel rank 1 (pid 7) died (signal SIGKILL)",
                       replace=True)
            started = time.monotonic()
            await client._watchdog()
            return client.death_reason, client.dead, time.monotonic() - started
        finally:
            receiver.cancel()
            client.close_sockets()

    reason, dead, waited = asyncio.run(scenario())
    assert dead and reason == "tensor-parallel rank 1 (pid 7) died (signal SIGKILL)"
    assert waited < DEATH_REASON_GRACE_S / 2


def test_death_note_keeps_a_ranks_death_over_the_error_it_caused(tmp_path) -> None:
    """The note lives beside the ipc sockets (none for other addresses); a rank's death (replace=True) overwrites
    a collective's error, a later error (replace=False) does not overwrite the note it finds."""
    from decode_server.runtime.death_note import note_path, read_note, write_note

    addr = f"ipc://{tmp_path}/from_engine"
    assert note_path(addr) == tmp_path / "engine_death_reason"
    assert note_path("tcp://127.0.0.1:5555") is None and read_note("tcp://127.0.0.1:5555") == ""
    write_note("tcp://127.0.0.1:5555", "ignored", replace=True)  # no file anywhere, no error
    assert read_note(addr) == ""
    write_note(addr, "RuntimeError: Connection closed by peer", replace=False)
    assert read_note(addr) == "RuntimeError: Connection closed by peer"
    write_note(addr, "tensor-parallel rank 1 (pid 7) died (signal SIGKILL)", replace=True)
    write_note(addr, "RuntimeError: a later error", replace=False)
    assert read_note(addr) == "tensor-parallel rank 1 (pid 7) died (signal SIGKILL)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine_death_reason"]  # no temporary file left
    write_note(f"ipc://{tmp_path}/missing/from_engine", "x", replace=True)  # unwritable directory: swallowed
