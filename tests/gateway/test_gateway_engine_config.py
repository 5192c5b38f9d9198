"""Configuration from the edge to the engine: CLI flags and environment -> Settings -> the driver's
config -> each engine's EngineConfig, with every default taken from the layer that owns it."""

from __future__ import annotations

import pytest

from drivers.native import NativeDriverConfig
from drivers.options import EngineOptions
from drivers.synthetic import SyntheticDriver
from engine_native.config import CacheConfig, EngineConfig, SchedulerConfig
from gateway.cli import build_parser, engine_options
from gateway.settings import Settings


def serve_options(argv: list[str], env: dict[str, str] | None = None) -> EngineOptions:
    settings = Settings.from_env(env or {})
    args = build_parser(settings).parse_args(["serve", *argv])
    return engine_options(args)


def test_unset_knobs_keep_the_engine_defaults() -> None:
    config = NativeDriverConfig.from_options(serve_options([]))
    assert config.engine.scheduler == SchedulerConfig()
    assert config.engine.cache == CacheConfig()
    assert config.engine.dtype == EngineConfig(model_path="x").dtype
    assert config.engine.prefill_attention_dtype == EngineConfig(model_path="x").prefill_attention_dtype
    assert config.engine.bf16_panel_max_rows == EngineConfig(model_path="x").bf16_panel_max_rows
    assert config.num_engines == 1
    assert config.engine_config(0).node_id == "node-0"


def test_environment_then_flags_reach_every_engine() -> None:
    env = {"SLUICE_MAX_WAITING": "7", "SLUICE_MAX_WAITING_TOKENS": "900", "SLUICE_MODEL": "/m.gguf"}
    config = NativeDriverConfig.from_options(serve_options(["--engines", "2", "--max-num-seqs", "3"], env))
    engines = [config.engine_config(i) for i in range(config.num_engines)]
    assert [e.node_id for e in engines] == ["node-0", "node-1"]
    for e in engines:
        assert (e.scheduler.max_waiting, e.scheduler.max_waiting_tokens, e.scheduler.max_num_seqs) == (7, 900, 3)
        assert e.model_path == "/m.gguf"
    flag_wins = NativeDriverConfig.from_options(serve_options(["--max-waiting", "11"], env))
    assert flag_wins.engine.scheduler.max_waiting == 11
    wave = NativeDriverConfig.from_options(serve_options(["--wave-budget-factor", "1"]))
    assert wave.engine.scheduler.wave_budget_factor == 1
    kv = NativeDriverConfig.from_options(serve_options(["--engines", "2", "--prefill-attention-dtype", "kv"]))
    assert [kv.engine_config(i).prefill_attention_dtype for i in range(2)] == ["kv", "kv"]


def test_the_bf16_panel_flag_reaches_the_engine_and_a_negative_one_is_refused() -> None:
    config = NativeDriverConfig.from_options(serve_options(["--engines", "2", "--bf16-panel-max-rows", "0"]))
    assert [config.engine_config(i).bf16_panel_max_rows for i in range(2)] == [0, 0]
    with pytest.raises(SystemExit):
        serve_options(["--bf16-panel-max-rows", "-1"])


def test_the_prompt_order_flag_reaches_the_engine_and_a_negative_or_nan_one_is_refused() -> None:
    config = NativeDriverConfig.from_options(serve_options(["--engines", "2", "--prompt-order-ms-per-token", "0"]))
    assert [config.engine_config(i).scheduler.prompt_order_ms_per_token for i in range(2)] == [0.0, 0.0]
    for bad in ("-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit):
            serve_options(["--prompt-order-ms-per-token", bad])


def test_zero_waiting_tokens_means_no_token_bound() -> None:
    config = NativeDriverConfig.from_options(serve_options(["--max-waiting-tokens", "0"]))
    assert config.engine.scheduler.max_waiting_tokens is None


def test_the_synthetic_driver_takes_the_knobs_it_has() -> None:
    driver = SyntheticDriver.from_options(
        serve_options(["--max-num-seqs", "5", "--max-waiting", "6", "--synthetic-ttft-ms", "20"])
    )
    assert (driver.max_num_seqs, driver.max_waiting, driver.ttft_s) == (5, 6, 0.02)
    defaults = SyntheticDriver.from_options(serve_options([]))
    assert (defaults.max_num_seqs, defaults.max_waiting) == (SchedulerConfig().max_num_seqs, SchedulerConfig().max_waiting)


def test_step_trace_gives_each_engine_its_own_file() -> None:
    config = NativeDriverConfig.from_options(serve_options(["--engines", "2", "--step-trace", "/tmp/traces"]))
    assert [config.engine_config(i).step_trace_path for i in range(2)] == [
        "/tmp/traces/node-0.jsonl", "/tmp/traces/node-1.jsonl"
    ]
    from dataclasses import replace

    version = replace(config, node_prefix="v2/node")  # a second model version's nodes: no subfolder per version
    assert version.engine_config(0).step_trace_path == "/tmp/traces/v2_node-0.jsonl"
    assert NativeDriverConfig.from_options(serve_options([])).engine_config(0).step_trace_path is None


def test_the_burst_hold_flag_reaches_the_engine_in_seconds_and_a_negative_one_is_refused() -> None:
    config = NativeDriverConfig.from_options(serve_options(["--engines", "2", "--burst-hold-ms", "40"]))
    assert [config.engine_config(i).scheduler.burst_hold_s for i in range(2)] == [0.04, 0.04]
    off = NativeDriverConfig.from_options(serve_options(["--burst-hold-ms", "0"]))
    assert off.engine.scheduler.burst_hold_s == 0.0
    for bad in ("-1", "nan", "x"):
        with pytest.raises(SystemExit):
            serve_options(["--burst-hold-ms", bad])


def test_the_int8_activation_flag_reaches_every_engine_and_a_negative_one_is_refused() -> None:
    config = NativeDriverConfig.from_options(serve_options(["--engines", "2", "--int8-activation-max-rows", "1"]))
    assert [config.engine_config(i).int8_activation_max_rows for i in range(2)] == [1, 1]
    assert NativeDriverConfig.from_options(serve_options([])).engine.int8_activation_max_rows == 0
    for bad in ("-1", "x", "1.5"):
        with pytest.raises(SystemExit):
            serve_options(["--int8-activation-max-rows", bad])


def test_the_int16_activation_flag_reaches_every_engine_and_unset_leaves_the_engines_default() -> None:
    config = NativeDriverConfig.from_options(serve_options(["--engines", "2", "--int16-activation-max-rows", "0"]))
    assert [config.engine_config(i).int16_activation_max_rows for i in range(2)] == [0, 0]
    assert NativeDriverConfig.from_options(serve_options([])).engine.int16_activation_max_rows is None  # by CPU
    for bad in ("-1", "x", "1.5"):
        with pytest.raises(SystemExit):
            serve_options(["--int16-activation-max-rows", bad])


def test_the_kv_dtype_flag_reaches_every_engine_and_unset_leaves_the_engines_default() -> None:
    config = NativeDriverConfig.from_options(serve_options(["--engines", "2", "--kv-dtype", "float32"]))
    assert [config.engine_config(i).kv_dtype for i in range(2)] == ["float32", "float32"]
    assert NativeDriverConfig.from_options(serve_options([])).engine.kv_dtype is None  # by model and CPU
    for bad in ("int8", "fp16", ""):
        with pytest.raises(SystemExit):
            serve_options(["--kv-dtype", bad])
