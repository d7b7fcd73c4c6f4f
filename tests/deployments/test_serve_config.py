"""The serving config: unknown keys and bad values are errors that name them; the example configs load."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.config import gRPCOptions

from deployments.app import grpc_options
from deployments.serve_config import dump_config, load_config, parse_config
from specdec_core.errors import InvalidArgument

CONFIGS = Path(__file__).resolve().parents[2] / "deployments" / "configs"


def test_unknown_keys_are_named():
    with pytest.raises(InvalidArgument) as err:
        parse_config({"target": {"model": "m", "dtyp": "bfloat16"}, "grcp_port": 1})
    assert "target.dtyp" in str(err.value) and "grcp_port" in str(err.value)


@pytest.mark.parametrize(
    "config, field",
    [
        ({}, "target"),
        ({"target": {"model": "m"}, "draft": {"method": "draft_model"}}, "draft"),
        ({"target": {"model": "m"}, "draft": {"method": "hybrid"}}, "draft"),  # hybrid runs a draft model too
        (
            {"target": {"model": "m"}, "draft": {"method": "hybrid", "model": "d", "suffix_min_prob": 2}},
            "draft.suffix_min_prob",
        ),
        ({"target": {"model": "m"}, "draft": {"method": "beam"}}, "draft.method"),
        ({"target": {"model": "m", "dtype": "int4"}}, "target.dtype"),
        ({"target": {"model": "m"}, "grpc_port": 0}, "grpc_port"),
        (
            {"target": {"model": "m"}, "draft": {"method": "ngram", "num_speculative_tokens": "many"}},
            "draft.num_speculative_tokens",
        ),
        ({"target": {"model": "m"}, "draft": {"method": "suffix", "suffix_max_depth": 1}}, "draft.suffix_max_depth"),
        ({"target": {"model": "m"}, "draft": {"method": "suffix", "suffix_min_prob": 2}}, "draft.suffix_min_prob"),
        (
            {"target": {"model": "m"}, "draft": {"model": "d", "confidence_threshold": 1.0}},
            "draft.confidence_threshold",
        ),
        ({"target": {"model": "m"}, "draft": {"model": "d", "vocabulary": -1}}, "draft.vocabulary"),
        (
            {"target": {"model": "m"}, "draft": {"method": "suffix", "suffix_max_depth": 8, "suffix_min_match": 5}},
            "suffix_min_match",
        ),
        ({"target": {"model": "m"}, "internal_tls": False, "internal_tls_dir": "/etc/specdec/tls"}, "internal_tls_dir"),
        ({"target": {"model": "m"}, "internal_tls": "sometimes"}, "internal_tls"),
        (
            {"target": {"model": "m"}, "proposal_log": {"directory": "/tmp/l", "include_context_tokens": -1}},
            "proposal_log.include_context_tokens",
        ),
    ],
)
def test_bad_values_name_the_key(config, field):
    with pytest.raises(InvalidArgument) as err:
        parse_config(config)
    assert field in str(err.value)


def test_the_proposal_log_keeps_no_context_unless_asked():
    config = parse_config({"target": {"model": "m"}, "proposal_log": {"directory": "/tmp/l"}})
    assert config.proposal_log.include_context_tokens == 0


def test_an_unknown_drafting_method_is_refused_naming_the_registered_ones():
    with pytest.raises(InvalidArgument) as err:
        parse_config({"target": {"model": "m"}, "draft": {"method": "beam"}})
    assert "draft.method" in str(err.value)
    assert all(name in str(err.value) for name in ("draft_model", "ngram", "none"))


def test_the_confidence_threshold_reaches_the_spec_and_is_off_by_default():
    assert parse_config({"target": {"model": "m"}, "draft": {"model": "d"}}).draft.spec.confidence_threshold == 0.0
    config = parse_config({"target": {"model": "m"}, "draft": {"model": "d", "confidence_threshold": 0.7}})
    assert config.draft.spec.confidence_threshold == 0.7


def test_suffix_options_reach_the_spec():
    config = parse_config(
        {
            "target": {"model": "m"},
            "draft": {
                "method": "suffix",
                "suffix_max_depth": 48,
                "suffix_min_match": 3,
                "suffix_max_requests": 10,
                "suffix_min_prob": 0.25,
                "suffix_index_prompts": False,
            },
        }
    )
    spec = config.draft.spec
    assert (spec.method, spec.suffix_max_depth, spec.suffix_min_match, spec.suffix_max_requests) == (
        "suffix",
        48,
        3,
        10,
    )
    assert spec.suffix_min_prob == 0.25 and spec.suffix_index_prompts is False


@pytest.mark.parametrize(
    "draft, workers, label",
    [
        ({"method": "draft_model", "model": "d"}, True, "d"),
        ({"method": "ngram"}, False, "ngram"),
        ({"method": "suffix"}, False, "suffix"),
        ({"method": "none"}, False, "none"),
    ],
)
def test_the_method_decides_whether_draft_workers_run(draft, workers, label):
    from deployments.launch import cpus_needed

    config = parse_config({"target": {"model": "m", "num_cpus": 2}, "draft": {**draft, "num_cpus": 4}})
    assert config.draft.runs_draft_model is workers and config.draft.label == label
    assert cpus_needed(config) == 2 + 0.5 + (4 if workers else 0) + 1  # target, router, draft workers, Serve


@pytest.mark.parametrize("path", sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("serve_")))
def test_example_configs_load(path):
    config = load_config(path)
    assert config.target.model


@pytest.mark.parametrize("path", sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("serve_")))
def test_a_dumped_config_loads_back_equal(path, tmp_path):
    config = load_config(path)
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(dump_config(config))
    assert load_config(dumped) == config
    assert yaml.safe_load(dumped.read_text())["draft"]["method"] == config.draft.method  # even the default one


def test_a_dump_holds_only_what_differs_from_the_defaults():
    assert yaml.safe_load(dump_config(parse_config({"target": {"model": "m"}, "grpc_port": 9001}))) == {
        "grpc_port": 9001,
        "target": {"model": "m"},
    }


def test_serve_config_args_are_a_specdec_config():
    serve_config = yaml.safe_load((CONFIGS / "serve_demo_cpu.yaml").read_text())
    app = serve_config["applications"][0]
    assert app["import_path"] == "deployments.app:build" and app["name"] == "specdec"
    assert parse_config(app["args"]).grpc_port == serve_config["grpc_options"]["port"]
    # Serve's gRPC proxy as `specdec serve` starts it: the same services (health too), reflection on.
    assert gRPCOptions(**serve_config["grpc_options"]) == grpc_options(parse_config(app["args"]))


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(InvalidArgument, match="no config file"):
        load_config(tmp_path / "nope.yaml")


def test_the_builder_makes_an_application_without_a_cluster():
    from ray.serve import Application

    from deployments.app import build

    app = build({"target": {"model": "m"}, "draft": {"method": "draft_model", "model": "d", "num_replicas": 2}})
    assert isinstance(app, Application)


@pytest.mark.parametrize("given, expected", [({}, True), ({"prefix_caching": False}, False)])
def test_prefix_caching_is_on_by_default_and_reaches_both_workers_runners(given, expected):
    from deployments.worker_deployments import _runner_config

    config = parse_config({"target": {"model": "m"}, "draft": {"method": "draft_model", "model": "d"}, **given})
    assert config.prefix_caching is expected
    assert _runner_config(config, config.target).prefix_caching is expected
    assert _runner_config(config, config.draft).prefix_caching is expected
    with pytest.raises(InvalidArgument, match="prefix_caching"):
        parse_config({"target": {"model": "m"}, "prefix_caching": "sometimes"})


def test_internal_tls_is_on_by_default_with_made_certificates():
    from deployments.tls import TlsSetting

    assert parse_config({"target": {"model": "m"}}).tls_setting == TlsSetting(enabled=True, directory=None)
    mounted = parse_config({"target": {"model": "m"}, "internal_tls_dir": "/etc/specdec/tls"})
    assert mounted.tls_setting == TlsSetting(True, "/etc/specdec/tls")
    assert parse_config({"target": {"model": "m"}, "internal_tls": False}).tls_setting == TlsSetting(False, None)


def test_a_config_naming_only_the_models_gets_the_performing_defaults():
    """Torch threads from the cores the worker has (not from the num_cpus reservation), and an int8 draft where
    the CPU runs it: a new user's config runs as the demo config does."""
    config = parse_config({"target": {"model": "m"}, "draft": {"method": "draft_model", "model": "d"}})
    assert config.target.threads == config.draft.threads == "auto"
    assert config.target.num_cpus == config.draft.num_cpus == 1.0  # the reservation stays what it was
    assert config.draft.quantization == "auto"


@pytest.mark.parametrize("threads", [1, 4, "auto"])
def test_threads_are_a_number_or_auto(threads):
    config = parse_config(
        {
            "target": {"model": "m", "threads": threads},
            "draft": {"method": "draft_model", "model": "d", "threads": threads},
        }
    )
    assert config.target.threads == config.draft.threads == threads


@pytest.mark.parametrize("threads", [0, -2, "all", 1.5, True])
def test_bad_threads_are_named(threads):
    with pytest.raises(InvalidArgument, match="target.threads"):
        parse_config({"target": {"model": "m", "threads": threads}})


@pytest.mark.parametrize(
    ("target", "draft", "overlap"),
    [
        ({}, {}, "off"),  # one machine's cores, shared
        ({"cpu_affinity": [0]}, {"cpu_affinity": [1]}, "auto"),  # cores apart
        ({"cpu_affinity": [0, 1]}, {"cpu_affinity": [1]}, "off"),
        ({"resources": {"target_node": 1}}, {"resources": {"draft_node": 1}}, "auto"),  # nodes of their own
        ({"device": "cuda", "num_gpus": 1}, {"device": "cuda", "num_gpus": 1}, "auto"),
        ({}, {"overlap": "on"}, "on"),  # asked for: as asked
    ],
)
def test_auto_overlap_is_off_where_the_draft_shares_the_targets_cores(target, draft, overlap):
    config = parse_config(
        {"target": {"model": "m", **target}, "draft": {"method": "draft_model", "model": "d", **draft}}
    )
    assert config.overlap == overlap
    assert parse_config({"target": {"model": "m"}, "draft": {"method": "ngram", "overlap": "on"}}).overlap == "off"


def test_overlap_written_bare_in_yaml_is_on_or_off(tmp_path):
    from deployments.serve_config import load_config

    for bare, value in (("on", "on"), ("off", "off"), ("auto", "auto")):
        path = tmp_path / f"{bare}.yaml"
        path.write_text(f"target: {{model: m}}\ndraft: {{method: draft_model, model: d, overlap: {bare}}}\n")
        assert load_config(path).draft.overlap == value


def test_cores_of_their_own_and_overlap():
    config = parse_config(
        {
            "target": {"model": "m", "cpu_affinity": [0]},
            "draft": {"method": "draft_model", "model": "d", "cpu_affinity": [1, 2], "overlap": "on"},
        }
    )
    assert (config.target.cpu_affinity, config.draft.cpu_affinity, config.draft.overlap) == ([0], [1, 2], "on")
    assert parse_config({"target": {"model": "m"}, "draft": {"method": "draft_model", "model": "d"}}).draft.overlap == (
        "auto"
    )


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"target": {"model": "m", "cpu_affinity": []}}, "target.cpu_affinity"),
        ({"target": {"model": "m", "cpu_affinity": [0, 0]}}, "target.cpu_affinity"),
        ({"target": {"model": "m", "cpu_affinity": [-1]}}, "target.cpu_affinity"),
        ({"target": {"model": "m", "cpu_affinity": [0], "tensor_parallel_size": 2}}, "target"),
        ({"target": {"model": "m"}, "draft": {"method": "draft_model", "model": "d", "overlap": 1}}, "draft.overlap"),
    ],
)
def test_bad_cores_and_overlap_are_named(config, field):
    with pytest.raises(InvalidArgument, match=field):
        parse_config(config)


@pytest.mark.parametrize("quantization", ["none", "int8", "int4", "auto"])
def test_draft_quantization_values(quantization):
    config = parse_config(
        {"target": {"model": "m"}, "draft": {"method": "draft_model", "model": "d", "quantization": quantization}}
    )
    assert config.draft.quantization == quantization
    with pytest.raises(InvalidArgument, match="draft.quantization"):
        parse_config(
            {"target": {"model": "m"}, "draft": {"method": "draft_model", "model": "d", "quantization": "int2"}}
        )


# -- many nodes: where the ranks, the router and the proxies go --------------------------------------------------

TP2 = {"model": "m", "tensor_parallel_size": 2}


@pytest.mark.parametrize("strategy", ["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
def test_the_ranks_placement_strategy_is_rays(strategy):
    from deployments.app import rank_group

    target = parse_config({"target": {**TP2, "placement_strategy": strategy}}).target
    assert target.rank_strategy == strategy == rank_group(target)["placement_group_strategy"]


@pytest.mark.parametrize("gpus, strategy", [(0, "PACK"), (1, "STRICT_PACK")])
def test_ranks_pack_by_default_and_keep_to_one_node_with_gpus(gpus, strategy):
    assert parse_config({"target": {**TP2, "num_gpus": gpus}}).target.rank_strategy == strategy


def test_every_rank_reserves_what_the_replica_driving_them_reserves():
    """The replica is rank 0 and sits in bundle 0: each bundle holds a rank's num_cpus, num_gpus and resources."""
    from deployments.app import rank_group

    target = parse_config(
        {"target": {**TP2, "tensor_parallel_size": 3, "num_cpus": 2, "num_gpus": 1, "resources": {"target_node": 1}}}
    ).target
    group = rank_group(target)
    assert group["placement_group_bundles"] == [{"CPU": 2, "GPU": 1, "target_node": 1}] * 3
    cpu_only = rank_group(parse_config({"target": {**TP2, "resources": {"big": 0.5}}}).target)
    assert cpu_only["placement_group_bundles"] == [{"CPU": 1, "big": 0.5}] * 2  # no GPU key where none is asked


def test_the_ranks_interface_reaches_gloo_and_nccl():
    target = parse_config({"target": {**TP2, "socket_ifname": "eth1,eth2"}}).target
    assert target.rank_environment == {"GLOO_SOCKET_IFNAME": "eth1,eth2", "NCCL_SOCKET_IFNAME": "eth1,eth2"}
    assert parse_config({"target": TP2}).target.rank_environment == {}


@pytest.mark.parametrize(
    "target, field",
    [
        ({**TP2, "placement_strategy": "STRICT"}, "target.placement_strategy"),
        ({**TP2, "placement_strategy": "pack"}, "target.placement_strategy"),
        ({**TP2, "socket_ifname": "eth 1"}, "target.socket_ifname"),
        ({**TP2, "socket_ifname": ""}, "target.socket_ifname"),
        ({**TP2, "socket_ifname": "eth1,"}, "target.socket_ifname"),
        ({"model": "m", "placement_strategy": "SPREAD"}, "placement_strategy"),  # one rank: nothing to place
        ({"model": "m", "socket_ifname": "eth1"}, "socket_ifname"),
    ],
)
def test_bad_rank_settings_are_named(target, field):
    with pytest.raises(InvalidArgument) as err:
        parse_config({"target": target})
    assert field in str(err.value) and "target" in str(err.value)


@pytest.mark.parametrize("location", ["EveryNode", "HeadOnly", "Disabled"])
def test_the_proxy_location_is_serves(location):
    assert parse_config({"target": {"model": "m"}, "proxy_location": location}).proxy_location == location
    assert parse_config({"target": {"model": "m"}}).proxy_location is None  # Serve's own default
    with pytest.raises(InvalidArgument, match="proxy_location"):
        parse_config({"target": {"model": "m"}, "proxy_location": "everywhere"})


def test_the_router_takes_custom_resources():
    config = parse_config({"target": {"model": "m"}, "router": {"resources": {"router_node": 1}}})
    assert config.router.resources == {"router_node": 1}
    assert parse_config({"target": {"model": "m"}}).router.resources == {}


def test_a_proxy_location_in_a_serve_configs_args_is_called_out(caplog):
    """Under `serve run` / `serve deploy` Serve is started by the Serve config: the key in `args` cannot move it."""
    from deployments.app import build

    with caplog.at_level("WARNING", logger="deployments.app"):
        build({"target": {"model": "m"}, "proxy_location": "HeadOnly"})
    assert "proxy_location" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="deployments.app"):
        build({"target": {"model": "m"}})
    assert "proxy_location" not in caplog.text


# -- A/B of drafts -------------------------------------------------------------------------------------------------

VARIANTS = [
    {"name": "base", "method": "draft_model", "model": "d1", "weight": 3, "num_cpus": 2},
    {"name": "tuned", "method": "draft_model", "model": "d2", "weight": 1, "num_replicas": 2},
    {"name": "lookup", "method": "suffix", "weight": 0},
]


def test_drafts_make_the_control_the_draft_and_a_deployment_per_model_variant():
    from deployments.app import build_app
    from deployments.launch import cpus_needed

    config = parse_config({"target": {"model": "t"}, "drafts": VARIANTS, "ab": {"control": "tuned"}})
    assert [v.name for v in config.variants] == ["base", "tuned", "lookup"]
    assert config.control_variant.name == "tuned" and (config.draft.model, config.draft.num_replicas) == ("d2", 2)
    assert parse_config(config.model_dump(mode="json")) == config  # what every deployment is handed
    assert cpus_needed(config) == 1 + 0.5 + 2 + 1 * 2 + 1  # target, router, base, tuned x 2, Serve
    workers = [app._bound_deployment for app in build_app(config)._bound_deployment.init_args[1:]]
    assert [(w.name, w.init_args[1:]) for w in workers] == [
        ("TargetWorker", ()),
        ("DraftWorker-base", ("base",)),
        ("DraftWorker-tuned", ("tuned",)),
    ]


def test_a_single_draft_is_the_variant_default():
    config = parse_config({"target": {"model": "t"}, "draft": {"method": "hybrid", "model": "d"}})
    (variant,) = config.variants
    assert (variant.name, variant.method, variant.weight) == ("default", "hybrid", 1.0)


@pytest.mark.parametrize(
    "change, field, words",
    [
        ({"drafts": []}, "config", "at least one"),
        ({"drafts": [{**VARIANTS[0], "method": "hybrid"}]}, "drafts.0.method", "one of draft_model, ngram, suffix"),
        ({"drafts": [{**VARIANTS[0], "name": "Base"}]}, "drafts.0.name", "pattern"),
        ({"drafts": [VARIANTS[0], VARIANTS[0]]}, "config", "unique"),
        ({"drafts": [{**VARIANTS[0], "weight": 0}]}, "config", "weight > 0"),
        ({"drafts": VARIANTS, "ab": {"control": "nope"}}, "config", "ab.control"),
        ({"ab": {"control": "base"}}, "config", "there are none"),
        ({"drafts": VARIANTS, "draft": {"method": "ngram"}}, "config", "give only drafts"),
        ({"drafts": [VARIANTS[0], {**VARIANTS[1], "max_speculative_tokens": 4}]}, "config", "max_speculative_tokens"),
        ({"drafts": VARIANTS, "ab": {"demotion": {"min_rounds": 5000}}}, "ab.demotion", "min_rounds"),
        ({"drafts": VARIANTS, "ab": {"demotion": {"margin": 1.5}}}, "ab.demotion.margin", "less than 1"),
    ],
)
def test_bad_variants_are_named(change, field, words):
    with pytest.raises(InvalidArgument) as refused:
        parse_config({"target": {"model": "t"}, **change})
    assert refused.value.field.startswith(field) and words in refused.value.message, refused.value.message


# -- CUDA graphs ---------------------------------------------------------------------------------------------------

GRAPHS = {"max_batch": 8, "widths": [1, 2, 3, 4, 5]}


@pytest.mark.parametrize(
    "config, field",
    [
        ({"target": {"model": "m", "cuda_graphs": {"max_batch": 0, "widths": [1]}}}, "target.cuda_graphs.max_batch"),
        ({"target": {"model": "m", "cuda_graphs": {"max_batch": 2, "widths": []}}}, "target.cuda_graphs.widths"),
        ({"target": {"model": "m", "cuda_graphs": {"max_batch": 2, "widths": [0, 1]}}}, "target.cuda_graphs.widths"),
        (
            {"target": {"model": "m"}, "draft": {"model": "d", "cuda_graphs": {"max_batch": 2, "widths": [2, 1]}}},
            "draft.cuda_graphs.widths",
        ),
        ({"target": {"model": "m", "cuda_graphs": {"max_batch": 2, "widths": [1, 1]}}}, "target.cuda_graphs.widths"),
        ({"target": {"model": "m", "cuda_graphs": {"max_batch": 2}}}, "target.cuda_graphs.widths"),
        ({"target": {"model": "m", "cuda_graphs": {**GRAPHS, "pool": "shared"}}}, "target.cuda_graphs.pool"),
        ({"target": {"model": "m", "cuda_graphs": "on"}}, "target.cuda_graphs"),
    ],
)
def test_bad_cuda_graphs_are_named(config, field):
    with pytest.raises(InvalidArgument) as err:
        parse_config(config)
    assert f"{field}:" in str(err.value)


def test_cuda_graphs_are_off_by_default_and_off_parses_bare_or_quoted(tmp_path):
    assert parse_config({"target": {"model": "m"}}).target.cuda_graphs is None
    assert parse_config({"target": {"model": "m", "cuda_graphs": "off"}}).target.cuda_graphs is None
    path = tmp_path / "config.yaml"
    path.write_text("target: {model: m, cuda_graphs: off}\ndraft: {model: d, cuda_graphs: off}\n")  # YAML 1.1: false
    config = load_config(path)
    assert config.target.cuda_graphs is None and config.draft.cuda_graphs is None


def test_cuda_graphs_reach_the_runner_of_a_cuda_worker_and_a_dump_keeps_them(tmp_path):
    from deployments.serve_config import runner_graphs
    from specdec_core.cuda_graphs import GraphConfig

    config = parse_config(
        {
            "target": {"model": "m", "device": "cuda", "cuda_graphs": GRAPHS},
            "draft": {"model": "d", "device": "cuda", "cuda_graphs": {"max_batch": 4, "widths": [1]}},
        }
    )
    assert runner_graphs(config.target) == GraphConfig(8, (1, 2, 3, 4, 5))
    assert runner_graphs(config.draft) == GraphConfig(4, (1,))
    assert runner_graphs(parse_config({"target": {"model": "m", "device": "cuda"}}).target) is None
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(dump_config(config))
    assert load_config(dumped) == config


def test_cuda_graphs_on_a_cpu_device_are_accepted_and_ignored_with_one_log_line(caplog):
    from deployments.serve_config import runner_graphs

    config = parse_config({"target": {"model": "m", "cuda_graphs": GRAPHS}})
    with caplog.at_level("INFO", logger="ray.serve"):
        assert runner_graphs(config.target) is None
    assert [r.getMessage() for r in caplog.records if "cuda_graphs" in r.getMessage()] == [
        "cuda_graphs ignored: the worker's device is cpu, and CUDA graphs need CUDA"
    ]


@pytest.mark.parametrize(
    "config, words",
    [
        (
            {"target": {"model": "m", "device": "cuda", "tensor_parallel_size": 2, "cuda_graphs": GRAPHS}},
            "tensor_parallel_size 1",
        ),
        (
            {
                "target": {"model": "m"},
                "draft": {"model": "d", "device": "cuda", "vocabulary": 1024, "cuda_graphs": GRAPHS},
            },
            "vocabulary 0",
        ),
    ],
)
def test_cuda_graphs_are_refused_where_a_worker_cannot_capture_them(config, words):
    with pytest.raises(InvalidArgument, match=words) as err:
        parse_config(config)
    assert "cuda_graphs" in str(err.value)
    on_cpu = {key: {**value, "device": "cpu"} for key, value in config.items()}  # there the same keys are ignored
    assert parse_config(on_cpu).target.device == "cpu"


def test_the_workers_runners_get_cuda_graphs_on_a_cuda_device_and_none_on_the_cpu():
    from deployments.worker_deployments import _runner_config
    from specdec_core.cuda_graphs import GraphConfig

    graphs = {"max_batch": 8, "widths": [1, 2, 3]}
    for device, expected in (("cuda", GraphConfig(8, (1, 2, 3))), ("cpu", None)):
        config = parse_config(
            {
                "target": {"model": "t", "device": device, "cuda_graphs": graphs},
                "draft": {"method": "draft_model", "model": "d", "device": device, "cuda_graphs": graphs},
            }
        )
        assert _runner_config(config, config.target).cuda_graphs == expected
        assert _runner_config(config, config.draft).cuda_graphs == expected
