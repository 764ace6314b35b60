"""Settings: defaults < config file < ATTNSERVE_* environment < flags, and precise errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnserve_server.errors import ConfigError
from attnserve_server.settings import OPTIONS, ServerSettings, load_settings, misspelt_variables, optional_inputs_kept

YAML = """
port: 6000
metrics_port: 6001
models:
  - name: small
    embed_dim: 64
    num_heads: 4
    device: [cpu]
    batching: {max_batch_size: 16, max_queue_delay_ms: 2.5}
  - name: bare
    kind: sdpa
    embed_dim: 32
    num_heads: 2
    vdim: 8
"""


def test_defaults_serve_one_default_model() -> None:
    s = load_settings()
    assert s == ServerSettings()
    assert [m.name for m in s.models] == ["default"] and s.models[0].embed_dim == 256


def test_yaml_and_toml_files(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text(YAML)
    s = load_settings(str(y))
    assert (s.port, s.metrics_port) == (6000, 6001)
    small, bare = s.models
    assert small.batching.max_batch_size == 16 and small.batching.max_queue_delay_ms == 2.5
    assert small.device == ("cpu",) and bare.kind == "sdpa" and bare.vdim == 8
    t = tmp_path / "c.toml"
    t.write_text('port = 7000\n[[models]]\nname = "t"\nembed_dim = 16\nnum_heads = 2\n[models.weights]\nseed = 3\n')
    s = load_settings(str(t))
    assert s.port == 7000 and s.models[0].weights.seed == 3


def test_environment_beats_file_and_flags_beat_environment(tmp_path: Path) -> None:
    y = tmp_path / "c.yaml"
    y.write_text(YAML)
    env = {"ATTNSERVE_CONFIG": str(y), "ATTNSERVE_PORT": "6100", "ATTNSERVE_MAX_BATCH_SIZE": "4"}
    s = load_settings(env=env, flags={"max_batch_size": 2, "device": "cpu,cuda:1"})
    assert s.port == 6100
    assert [m.batching.max_batch_size for m in s.models] == [2, 2]  # model flags apply to every model
    assert s.models[0].device == ("cpu", "cuda:1")


def test_every_option_has_a_flag_and_an_environment_variable() -> None:
    assert len({o.flag for o in OPTIONS}) == len(OPTIONS)
    assert all(o.env == "ATTNSERVE_" + o.flag.upper().replace("-", "_") for o in OPTIONS)


def test_weights_flag_implies_torch_format() -> None:
    s = load_settings(flags={"weights": "w.safetensors"})
    assert s.models[0].weights.format == "torch" and s.models[0].weights.path == "w.safetensors"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ATTNSERVE_NUM_HEADS": "3"}, "embed_dim: 256 is not divisible by num_heads 3"),
        ({"ATTNSERVE_DTYPE": "float64"}, "dtype: expected one of"),
        ({"ATTNSERVE_CPU_MATMUL": "mkl"}, "cpu_matmul: expected one of auto, onednn, aten, got 'mkl'"),
        ({"ATTNSERVE_CPU_FUSED_BOUND": "head"}, "cpu_fused_bound: expected one of auto, batch, sequence, got 'head'"),
        ({"ATTNSERVE_DEVICE": "tpu"}, "device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
        ({"ATTNSERVE_PORT": "many"}, "ATTNSERVE_PORT: expected an integer, got 'many'"),
        ({"ATTNSERVE_BIAS": "maybe"}, "ATTNSERVE_BIAS: expected true or false"),
        ({"ATTNSERVE_MAX_BATCH_TOKENS": "10"}, "cannot hold one sequence of max_query_len 4096"),
        ({"ATTNSERVE_KIND": "sdpa", "ATTNSERVE_KDIM": "8"}, "the bare operation needs kdim == embed_dim"),
        ({"ATTNSERVE_WEIGHTS_FORMAT": "bert"}, "weights.path: format 'bert' needs a file"),
        ({"ATTNSERVE_EVENT_LOOP": "trio"}, "event_loop: expected one of auto, uvloop, asyncio, got 'trio'"),
        ({"ATTNSERVE_MIN_PARALLEL_SPEEDUP": "0.5"}, "min_parallel_speedup: expected 0 or >= 1, got 0.5"),
        ({"ATTNSERVE_IDLE_SPIN_MS": "-1"}, "idle_spin_ms: expected >= 0, got -1.0"),
        ({"ATTNSERVE_IDLE_SPIN_MS": "nan"}, "idle_spin_ms: expected >= 0, got nan"),
        ({"ATTNSERVE_LINGER_MACS": "-1"}, "batching.linger_macs: expected >= 0, got -1"),
        ({"ATTNSERVE_MAX_LINGER_MS": "nan"}, "batching.max_linger_ms: expected 0..60000 (a minute), got nan"),
        # Past gRPC's C ints, or a timer's range: a traceback at start-up, or the server stopped by its first request.
        ({"ATTNSERVE_MAX_LINGER_MS": "60001"}, "batching.max_linger_ms: expected 0..60000 (a minute), got 60001.0"),
        ({"ATTNSERVE_MAX_QUEUE_DELAY_MS": "1e300"}, "batching.max_queue_delay_ms: expected 0..60000 (a minute)"),
        ({"ATTNSERVE_MAX_MESSAGE_BYTES": str(2**40)}, "max_message_bytes: expected 1..2147483647 (gRPC's most)"),
        ({"ATTNSERVE_MAX_CONNECTIONS": str(2**40)}, "max_connections: expected 0..2147483647, got 1099511627776"),
        ({"ATTNSERVE_STREAM_WINDOW": "0"}, "stream_window: expected >= 1, got 0"),
        # Before: "cannot bind (in use, or not this host's)" for a port that cannot exist, or ":0" for no host.
        ({"ATTNSERVE_HEALTH_PORT": "70000"}, "health_port: expected -1 (off) or 0..65535, got 70000"),
        ({"ATTNSERVE_METRICS_PORT": "-2"}, "metrics_port: expected -1 (off) or 0..65535, got -2"),
        ({"ATTNSERVE_HOST": ""}, "host: expected an address to bind"),
        ({"ATTNSERVE_CPU_LANES": str(10**20)}, "cpu_lanes: expected 1..\\d+ .the CPUs this process may run on"),
        ({"ATTNSERVE_SEED": str(2**64)}, f"weights.seed: expected {-(2**63)}..{2**64 - 1}, got {2**64}"),  # traceback
        ({"ATTNSERVE_TORCH_THREADS": "100000"}, "torch_threads: expected 1..\\d+ .the CPUs this process may run on"),
        ({"ATTNSERVE_ACCEPT_COMPRESSION": "gzip,br"}, "accept_compression: expected gzip, deflate, a comma list"),
        ({"ATTNSERVE_MAX_CONNECTION_AGE_S": "-1"}, "max_connection_age_s: expected 0..2147483 seconds (gRPC counts"),
        ({"ATTNSERVE_MAX_CONNECTION_AGE_S": "1e9"}, "max_connection_age_s: expected 0..2147483 seconds"),
        ({"ATTNSERVE_KEEPALIVE_S": "inf"}, "keepalive_s: expected 0..2147483 seconds .*, got inf"),
        ({"ATTNSERVE_CLIENT_PING_MIN_S": "-2"}, "client_ping_min_s: expected 0..2147483 seconds .*, got -2.0"),
        ({"ATTNSERVE_CLIENT_PING_MIN_S": "1e9"}, "client_ping_min_s: expected 0..2147483 seconds .*, got 1000000000.0"),
        ({"ATTNSERVE_EDGE_PROCESSES": "0"}, "edge_processes: expected auto or >= 1, got 0"),
        ({"ATTNSERVE_EDGE_PROCESSES": "many"}, "ATTNSERVE_EDGE_PROCESSES: expected auto or an integer, got 'many'"),
        ({"ATTNSERVE_OPTIONAL_INPUTS": "mask"}, "optional_inputs: expected all, none or names among key_value,"),
        ({"ATTNSERVE_OPTIONAL_INPUTS": "all,key"}, "optional_inputs: 'all' and 'none' stand alone"),
        ({"ATTNSERVE_OPTIONAL_INPUTS": "key,key_lengths"}, "optional_inputs: key and value go together"),
        ({"ATTNSERVE_KIND": "sdpa", "ATTNSERVE_OPTIONAL_INPUTS": "key_value"}, "got 'key_value'"),
        (
            {"ATTNSERVE_KDIM": "64", "ATTNSERVE_VDIM": "64", "ATTNSERVE_OPTIONAL_INPUTS": "none"},
            "needs key_value or key and value in every request; keep one of them, got none",
        ),
    ],
)
def test_bad_settings_name_the_setting(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_settings(env=env)


def test_a_list_setting_may_be_empty_where_that_means_something(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("models:\n  - name: a\n    optional_inputs: []\n  - name: b\n    optional_inputs: none\n")
    a, b = load_settings(str(f)).models
    assert a.optional_inputs == () and optional_inputs_kept(a) == optional_inputs_kept(b) == ()
    f.write_text("models:\n  - name: a\n    device: []\n")
    with pytest.raises(ConfigError, match=r"models\[0\] \('a'\)\.device: expected at least one device, got none"):
        load_settings(str(f))


def test_a_misspelt_variable_is_named_with_the_closest_real_one() -> None:
    env = {"ATTNSERVE_METRIC_PORT": "1", "ATTNSERVE_PORT": "2", "ATTNSERVE_VENV": ".venv", "HOME": "/root"}
    assert misspelt_variables(env) == [
        "ATTNSERVE_METRIC_PORT is not an attnserve setting and is ignored; did you mean 'ATTNSERVE_METRICS_PORT'?"
    ]


def test_unknown_keys_and_duplicates_in_a_file_are_errors(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("models:\n  - name: a\n    heads: 4\n")
    with pytest.raises(ConfigError) as err:
        load_settings(str(f))
    assert str(err.value).startswith(f"config file {f}: models[0]: unknown setting 'heads'")
    f.write_text("metric_port: 1\nmodels:\n  - name: a\n    kidn: mha\n")
    with pytest.raises(ConfigError) as err:
        load_settings(str(f))
    assert str(err.value).startswith(
        f"config file {f}: top level: unknown setting 'metric_port'; did you mean 'metrics_port'?"
    )
    f.write_text("models:\n  - name: a\n  - name: a\n")
    with pytest.raises(ConfigError, match="duplicate model name"):
        load_settings(str(f))
    with pytest.raises(ConfigError, match="No such file"):
        load_settings(str(tmp_path / "missing.yaml"))


def test_a_list_or_a_mapping_where_a_file_wants_one_value_is_named(tmp_path: Path) -> None:
    # Before: int()'s own words for a port, and a host of "[1, 2]" taken as a string, to fail at bind.
    f = tmp_path / "c.yaml"
    for text, message in (
        ("port: [1, 2]\n", "port: expected an integer, got [1, 2]"),
        ("host: [1, 2]\n", "host: expected a string, got [1, 2]"),
        ("grace_s: {a: 1}\n", "grace_s: expected a number, got {'a': 1}"),
    ):
        f.write_text(text)
        with pytest.raises(ConfigError) as err:
            load_settings(str(f))
        assert str(err.value) == f"config file {f}: {message}"


def test_auto_dtype_is_bfloat16_on_gpus_only_and_float32_otherwise() -> None:
    import torch

    from attnserve_server.model import resolve_dtype

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_dtype("auto", [gpu, torch.device("cuda", 1)]) == "bfloat16"
    assert resolve_dtype("auto", [gpu, cpu]) == "float32"  # a CPU worker among them
    assert resolve_dtype("auto", [cpu]) == "float32" and resolve_dtype("auto") == "float32"
    assert resolve_dtype("float16", [gpu]) == "float16"  # what is asked for stays


def test_edge_processes_are_auto_by_default_or_a_count_and_auto_follows_the_gpu_and_the_cpus(monkeypatch) -> None:
    from attnserve_server.runtime import edges

    assert load_settings().edge_processes is None
    assert load_settings(env={"ATTNSERVE_EDGE_PROCESSES": "Auto"}).edge_processes is None
    assert load_settings(flags={"edge_processes": "3"}).edge_processes == 3
    assert load_settings(env={"ATTNSERVE_TORCH_THREADS": "auto"}).torch_threads is None  # torch's own count
    assert load_settings(env={"ATTNSERVE_METRICS_HOST": "auto"}).metrics_host == "auto"  # a name stays a name
    # the measured rule (runtime/edges.py): a GPU model gets one edge per 4 CPUs, 1 to 4; a CPU model one
    assert [edges.auto_edges(True, cpus) for cpus in (1, 2, 4, 8, 15, 16, 64)] == [1, 1, 1, 2, 3, 4, 4]
    assert [edges.auto_edges(False, cpus) for cpus in (2, 16, 64)] == [1, 1, 1]
    monkeypatch.setattr(edges, "usable_cpus", lambda: 16)
    assert edges.resolve(None, ["cuda"], {}) == (4, "auto: a GPU model, 16 CPUs")
    assert edges.resolve(None, ["cpu"], {}) == (1, "auto: no GPU model, 16 CPUs")
    assert edges.resolve(2, ["cuda"], {}) == (2, "as set")
    # `auto` devices count as a GPU only where a driver's device node shows and CUDA_VISIBLE_DEVICES hides none
    assert edges.resolve(None, ["auto"], {"CUDA_VISIBLE_DEVICES": ""}) == (1, "auto: no GPU model, 16 CPUs")


def test_usable_cpus_follow_the_affinity_and_a_container_quota(monkeypatch) -> None:
    from attnserve_server.runtime import edges

    monkeypatch.setattr(edges.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(edges, "cpu_quota", lambda: None)
    assert edges.usable_cpus() == 16
    monkeypatch.setattr(edges, "cpu_quota", lambda: 6.5)  # a pod limited to 6.5 CPUs
    assert edges.usable_cpus() == 6
    monkeypatch.setattr(edges, "cpu_quota", lambda: 0.5)
    assert edges.usable_cpus() == 1


def test_the_event_loop_is_uvloop_when_installed_asyncio_when_asked_and_a_clear_error_otherwise(monkeypatch) -> None:
    import asyncio
    import sys

    import uvloop

    from attnserve_server.errors import ConfigError
    from attnserve_server.runtime.eventloop import loop_factory

    assert loop_factory("auto") == ("uvloop", uvloop.new_event_loop)  # the server extra installs it
    assert loop_factory("asyncio") == ("asyncio", asyncio.new_event_loop)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed
    assert loop_factory("auto")[0] == "asyncio"
    with pytest.raises(ConfigError, match="event_loop: uvloop is not installed"):
        loop_factory("uvloop")
    with pytest.raises(ConfigError, match="event_loop: expected one of"):
        loop_factory("trio")


def test_lingering_reaches_the_batcher_in_its_own_units() -> None:
    from attnserve_server.model import limits_from_settings

    s = load_settings(env={}, flags={"linger_macs": 5_000_000, "max_linger_ms": 2.5})
    limits = limits_from_settings(s.models[0])
    assert (limits.linger_work, limits.max_linger_s) == (5_000_000, 0.0025)
    off = limits_from_settings(load_settings(env={"ATTNSERVE_LINGER_MACS": "0"}).models[0])
    assert off.linger_work == 0


def test_the_pipeline_work_bound_reaches_cpu_batchers_only() -> None:
    from attnserve_server.model import limits_from_settings
    from attnserve_server.settings import PIPELINE_MACS

    assert limits_from_settings(load_settings(env={}).models[0]).pipeline_work == PIPELINE_MACS == 0  # off
    on = load_settings(env={"ATTNSERVE_PIPELINE_MACS": "7"}).models[0]
    assert limits_from_settings(on).pipeline_work == 7
    assert limits_from_settings(on, cpu=False).pipeline_work == 0  # a GPU wants its batches whole
    with pytest.raises(ConfigError, match=r"batching.pipeline_macs: expected >= 0, got -1"):
        load_settings(env={}, flags={"pipeline_macs": -1})


def test_the_readme_documents_every_setting_by_its_flag_and_its_environment_variable() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    undocumented = [opt.flag for opt in OPTIONS if f"`--{opt.flag}`" not in readme or opt.env not in readme]
    assert undocumented == [], f"README.md's configuration tables lack {undocumented}"
