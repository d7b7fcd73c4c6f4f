"""`specdec serve` in vLLM's words: every flag lands in its config field, flags override the file and MODEL its
target, --speculative-config takes vLLM's keys, CONFIG.yaml alone serves as before, --print-config round-trips, and
every error names the flag at fault. Nothing here starts Ray: only the config is resolved (or printed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from deployments.serve_config import load_config
from specdec_core.errors import InvalidArgument
from specdec_tools import cli
from specdec_tools.serve_flags import Resolved, resolve

CONFIGS = Path(__file__).resolve().parents[2] / "deployments" / "configs"
SERVE_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("serve_"))


def _resolve(*argv: str) -> Resolved:
    return resolve(cli.build_parser().parse_args(["serve", *argv]))


def _spec(**keys: object) -> list[str]:
    return ["--speculative-config", json.dumps(keys)]


def _write(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


# The flag, and where its value must land. The base (MODEL and a draft model) leaves each field at another value.
BASE = ("target-model", *_spec(model="draft-model"))
FLAGS = [
    (["--port", "8123"], lambda c: c.http_port, 8123),
    (["--grpc-port", "9123"], lambda c: c.grpc_port, 9123),
    (["--served-model-name", "coder"], lambda c: (c.served_model_name, c.served_name), ("coder", "coder")),
    (["--max-model-len", "4096"], lambda c: c.router.max_seq_len, 4096),
    (["--tensor-parallel-size", "2"], lambda c: c.target.tensor_parallel_size, 2),
    (["-tp", "4"], lambda c: c.target.tensor_parallel_size, 4),
    (["--dtype", "half"], lambda c: (c.target.dtype, c.draft.dtype), ("float16", "float16")),
    (["--dtype", "float"], lambda c: (c.target.dtype, c.draft.dtype), ("float32", "float32")),
    (["--dtype", "float16"], lambda c: (c.target.dtype, c.draft.dtype), ("float16", "float16")),
    (["--max-num-seqs", "3"], lambda c: (c.target.max_sequences, c.draft.max_sequences), (3, 3)),
    (["--no-enable-prefix-caching"], lambda c: c.prefix_caching, False),
]


@pytest.mark.parametrize("argv, field, expected", FLAGS)
def test_every_flag_lands_in_its_field(argv, field, expected):
    assert field(_resolve(*BASE).config) != expected  # the flag, not a default, sets it
    assert field(_resolve(*BASE, *argv).config) == expected


def test_model_is_the_target_and_a_speculative_model_the_draft():
    config = _resolve("qwen2.5-coder-1.5b-instruct", *_spec(model="qwen2.5-coder-0.5b-instruct")).config
    assert config.target.model == "qwen2.5-coder-1.5b-instruct" and config.served_name == config.target.model
    assert (config.draft.method, config.draft.model) == ("draft_model", "qwen2.5-coder-0.5b-instruct")
    assert _resolve("target-model").config.draft.method == "none"  # no --speculative-config: no speculation


def test_prefix_caching_can_be_turned_back_on_over_the_file(tmp_path):
    path = _write(tmp_path / "c.yaml", {"target": {"model": "m"}, "prefix_caching": False})
    assert _resolve(path).config.prefix_caching is False
    assert _resolve(path, "--enable-prefix-caching").config.prefix_caching is True


def test_api_key_turns_auth_on_and_stays_out_of_the_config(tmp_path):
    path = _write(tmp_path / "c.yaml", {"target": {"model": "m"}, "auth": "none"})
    assert _resolve(path).config.auth == "none"
    resolved = _resolve(path, "--api-key", "s3cret")
    assert resolved.config.auth == "bearer" and resolved.api_key == "s3cret"
    assert "s3cret" not in resolved.config.model_dump_json()


def test_a_model_served_without_a_key_is_open_as_in_vllm_and_a_file_keeps_its_rule(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_AUTH_TOKEN", raising=False)
    assert _resolve("m").config.auth == "none"
    assert _resolve("m", "--api-key", "k").config.auth == "bearer"
    monkeypatch.setenv("SPECDEC_AUTH_TOKEN", "from-the-environment")
    assert _resolve("m").config.auth == "bearer"  # the router takes the token from its environment
    monkeypatch.delenv("SPECDEC_AUTH_TOKEN")
    path = _write(tmp_path / "c.yaml", {"target": {"model": "m"}})
    assert _resolve("m", "--config", path).config.auth == "bearer"  # the file's default: no token, no start


def test_flags_override_the_file_and_model_its_target(tmp_path):
    path = _write(
        tmp_path / "c.yaml",
        {
            "http_port": 8001,
            "target": {"model": "file-target", "num_cpus": 3},
            "draft": {"method": "ngram", "num_speculative_tokens": 2},
            "router": {"max_seq_len": 1024, "default_max_tokens": 64},
        },
    )
    config = _resolve("flag-target", "--config", path, "--port", "8002", "--max-model-len", "512").config
    assert (config.target.model, config.http_port, config.router.max_seq_len) == ("flag-target", 8002, 512)
    # What no flag touched is the file's.
    assert (config.target.num_cpus, config.router.default_max_tokens) == (3, 64)
    assert (config.draft.method, config.draft.num_speculative_tokens) == ("ngram", 2)


def test_a_config_file_alone_gives_its_target(tmp_path):
    path = _write(tmp_path / "c.yaml", {"target": {"model": "file-target"}, "grpc_port": 9100})
    config = _resolve("--config", path).config
    assert (config.target.model, config.grpc_port) == ("file-target", 9100)


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_a_yaml_positional_is_served_as_before(path):
    assert _resolve(str(path)).config == load_config(path)


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({"model": "d"}, {"method": "draft_model", "model": "d"}),
        ({"method": "draft_model", "model": "d"}, {"method": "draft_model", "model": "d"}),
        ({"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 2}, {"ngram_max": 5, "ngram_min": 2}),
        ({"method": "suffix"}, {"method": "suffix"}),
        ({"method": "hybrid", "model": "d"}, {"method": "hybrid", "model": "d"}),
        ({"method": "none"}, {"method": "none"}),
        ({"model": "d", "num_speculative_tokens": 5}, {"num_speculative_tokens": 5, "max_speculative_tokens": 8}),
        ({"model": "d", "num_speculative_tokens": "auto"}, {"num_speculative_tokens": "auto"}),
        # vLLM's k is also its largest: the config's largest rises to it.
        ({"model": "d", "num_speculative_tokens": 12}, {"num_speculative_tokens": 12, "max_speculative_tokens": 12}),
        ({"model": "d", "num_speculative_tokens": 3, "max_speculative_tokens": 6}, {"max_speculative_tokens": 6}),
        ({"model": "d", "quantization": "int4", "dtype": "float32"}, {"quantization": "int4", "dtype": "float32"}),
        ({"model": "d", "confidence_threshold": 0.5}, {"confidence_threshold": 0.5}),
    ],
)
def test_speculative_config_keys_land_in_the_draft(keys, expected):
    draft = _resolve("m", *_spec(**keys)).config.draft
    assert {name: getattr(draft, name) for name in expected} == expected


def test_speculative_config_changes_only_what_it_names_in_the_files_draft(tmp_path):
    path = _write(
        tmp_path / "c.yaml",
        {"target": {"model": "m"}, "draft": {"method": "hybrid", "model": "d", "num_cpus": 3, "quantization": "int8"}},
    )
    draft = _resolve(path, *_spec(num_speculative_tokens=2)).config.draft
    assert (draft.method, draft.model, draft.num_cpus, draft.quantization, draft.num_speculative_tokens) == (
        "hybrid",
        "d",
        3,
        "int8",
        2,
    )
    # vLLM's rule: a model without a method is a draft model, whatever the file's method was.
    draft = _resolve(path, *_spec(model="e")).config.draft
    assert (draft.method, draft.model, draft.num_cpus) == ("draft_model", "e", 3)


def test_the_speculative_configs_own_dtype_wins_over_dtype_for_the_draft():
    config = _resolve("m", *_spec(model="d", dtype="float32"), "--dtype", "half").config
    assert (config.target.dtype, config.draft.dtype) == ("float16", "float32")


def test_engine_flags_reach_every_variant_of_an_ab():
    config = _resolve(str(CONFIGS / "ab_cpu.yaml"), "--max-num-seqs", "5", "--dtype", "float32").config
    assert {v.max_sequences for v in config.drafts} == {5} and {v.dtype for v in config.drafts} == {"float32"}
    assert config.target.max_sequences == 5 and config.draft == config.control_variant.as_draft()


def test_gguf_files_are_models_for_the_target_and_the_draft(tmp_path):
    target, draft = str(tmp_path / "target.gguf"), str(tmp_path / "draft.gguf")
    config = _resolve(target, *_spec(model=draft)).config
    assert (config.target.model, config.draft.model, config.draft.method) == (target, draft, "draft_model")


@pytest.mark.parametrize(
    "argv",
    [
        ["qwen2.5-coder-1.5b-instruct", *_spec(model="qwen2.5-coder-0.5b-instruct", num_speculative_tokens=5)],
        [str(CONFIGS / "demo_cpu.yaml"), "--port", "8100", "--no-enable-prefix-caching", "--api-key", "k"],
        ["m", "--config", str(CONFIGS / "ab_cpu.yaml"), "--max-num-seqs", "4", "-tp", "2"],
        ["m", *_spec(method="ngram", prompt_lookup_max=3), "--dtype", "float32", "--served-model-name", "x"],
    ],
)
def test_print_config_prints_what_serves_alike(argv, tmp_path, capsys):
    assert cli.main(["serve", *argv, "--print-config"]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    assert load_config(printed) == _resolve(*argv).config
    assert _resolve(str(printed)).config == _resolve(*argv).config  # and `specdec serve printed.yaml` takes it


def test_serving_hands_the_api_key_to_the_router_through_the_environment(monkeypatch):
    import contextlib

    import deployments.launch
    from specdec_core.environment import AUTH_TOKEN

    monkeypatch.delenv(AUTH_TOKEN, raising=False)  # restored after the test, whatever serve sets
    seen = {}

    @contextlib.contextmanager
    def serving(config):  # stands in for the cluster: records what it was given, then stops as Ctrl-C would
        seen.update(config=config, token=os.environ.get(AUTH_TOKEN))
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(deployments.launch, "serving", serving)
    assert cli.main(["serve", "m", "--api-key", "s3cret", "--port", "8123"]) == 130
    assert seen["token"] == "s3cret" and (seen["config"].auth, seen["config"].http_port) == ("bearer", 8123)


def test_print_config_keeps_the_api_key_out(capsys):
    assert cli.main(["serve", "m", "--api-key", "s3cret", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "SPECDEC_AUTH_TOKEN" in out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["m", *_spec(model="d", num_speculative_tokens="many")], '--speculative-config: key "num_speculative_tokens"'),
        (["m", *_spec(model="d", num_speculative_tokens=-1)], '--speculative-config: key "num_speculative_tokens"'),
        (["m", *_spec(model="d", num_speculative_tokens=17)], '--speculative-config: key "num_speculative_tokens"'),
        (["m", *_spec(method="eagle")], '--speculative-config: key "method": unknown drafting method'),
        (["m", *_spec(draft_tensor_parallel_size=2)], '--speculative-config: unknown key "draft_tensor_parallel_size"'),
        (["m", *_spec(num_cpus=2)], '--speculative-config: unknown key "num_cpus"'),  # placement: the YAML's
        (["m", *_spec(num_speculative_tokens=3)], '--speculative-config: give "model"'),
        (["m", *_spec(method="draft_model")], '--speculative-config: key "method"'),
        (["m", *_spec(method="ngram", prompt_lookup_min=0)], '--speculative-config: key "prompt_lookup_min"'),
        (["m", *_spec(model="d", quantization="awq")], '--speculative-config: key "quantization"'),
        (["m", "--speculative-config", "[1, 2]"], "--speculative-config: expected a JSON object"),
        (["m", "--speculative-config", "{model: d}"], "--speculative-config: not valid JSON"),
        (["m", "--config", str(CONFIGS / "ab_cpu.yaml"), *_spec(model="d")], "--speculative-config: the config"),
        (["m", "--port", "70000"], "--port: "),
        (["m", "--grpc-port", "0"], "--grpc-port: "),
        (["m", "--max-model-len", "8"], "--max-model-len: "),
        (["m", "-tp", "0"], "--tensor-parallel-size: "),
        (["m", "--dtype", "auto"], "--dtype: "),
        (["m", "--max-num-seqs", "0"], "--max-num-seqs: "),
        (["m", "--served-model-name", ""], "--served-model-name: "),
        (["m", "--api-key", " "], "--api-key: "),
        ([], "MODEL: "),
        ([str(CONFIGS / "tiny.yaml"), "--config", str(CONFIGS / "tiny.yaml")], "--config: "),
        (["missing.yaml"], "config: no config file"),
    ],
)
def test_errors_name_the_flag(argv, expected, capsys):
    assert cli.main(["serve", *argv, "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: {expected}") and "Traceback" not in captured.err
    assert captured.out == ""  # nothing printed, nothing served


def test_a_bad_value_from_the_file_names_its_key_and_one_from_a_flag_the_flag(tmp_path):
    path = _write(tmp_path / "c.yaml", {"target": {"model": "m"}, "http_port": 0})
    with pytest.raises(InvalidArgument, match=r"^http_port: "):
        _resolve(path)
    assert _resolve(path, "--port", "8000").config.http_port == 8000  # the flag replaces the bad value
    with pytest.raises(InvalidArgument) as err:
        _resolve(path, "--grpc-port", "0")
    assert {part.split(":")[0] for part in str(err.value).split("; ")} == {"--grpc-port", "http_port"}


def test_a_tensor_parallel_flag_is_named_where_the_files_placement_refuses_it(tmp_path):
    path = _write(tmp_path / "c.yaml", {"target": {"model": "m", "cpu_affinity": [0, 1]}})
    with pytest.raises(InvalidArgument, match=r"^--tensor-parallel-size: cpu_affinity pins one process"):
        _resolve(path, "-tp", "2")


def test_unknown_flags_are_refused_as_argparse_does(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "m", "--gpu-memory-utilization", "0.9", "--print-config"])
    assert exit_.value.code == 2 and "--gpu-memory-utilization" in capsys.readouterr().err
