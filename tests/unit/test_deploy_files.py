"""The deploy files: cluster.yaml against Ray's own cluster schema; serve_config.yaml builds an app."""

import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.serve import Application
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from serve_app.config import CONTROLLER_ENV_VARS, AppConfig, load_config, read_config_file

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_follows_rays_schema():
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(cluster, schema)
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    workers = [t for name, t in types.items() if name != cluster["head_node_type"]]
    assert any(t["node_config"]["InstanceType"].startswith(("g", "p")) for t in workers)  # a GPU worker type
    assert all(t["min_workers"] <= t["max_workers"] <= cluster["max_workers"] for t in workers)
    assert any("-e ~/rwkv-fleet" in command for command in cluster["setup_commands"])


def test_serve_config_builds_an_application_without_ray():
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    deploy = ServeDeploySchema.model_validate(config)
    (app,) = deploy.applications
    module, name = app.import_path.split(":")
    builder = getattr(__import__(module, fromlist=[name]), name)
    assert isinstance(call_user_app_builder_with_args_if_necessary(builder, app.args), Application)
    assert AppConfig.model_validate(app.args).num_gpus == "auto"
    assert deploy.controller_options.runtime_env["env_vars"] == CONTROLLER_ENV_VARS  # as `rwkv-fleet serve` starts it
    scaled = {**app.args, "autoscaling": {"min_replicas": 1, "max_replicas": 8}}  # serve_config.yaml's commented block
    assert isinstance(call_user_app_builder_with_args_if_necessary(builder, scaled), Application)  # Serve takes both


def test_rwkv_fleet_serve_reads_serve_config_args():
    args = read_config_file(ROOT / "serve_config.yaml")
    assert args["engine"]["max_slots"] == 32 and args["port"] == 8000
    AppConfig.model_validate(args)


def test_api_keys_and_origins_from_the_file_and_the_flags(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text("api_keys: [sk-file]\n")
    config = load_config(path, api_keys=["sk-flag"])
    assert [k.get_secret_value() for k in config.api_keys] == ["sk-file", "sk-flag"]
    assert "sk-file" not in repr(config)  # (a config in a log shows no key)
    for bad in ("", "two words"):
        with pytest.raises(ValueError, match="api_keys: an API key is empty or holds whitespace"):
            load_config(None, api_keys=[bad])
    assert load_config(None, {"cors_allow_origins": ["https://chat.example.com:8443", "*"]}).cors_allow_origins
    for bad in ("https://chat.example.com/", "chat.example.com"):  # never equal to a browser's Origin header
        with pytest.raises(ValueError, match="is not an origin"):
            load_config(None, {"cors_allow_origins": [bad]})


def test_deployment_options_follow_the_config():
    config = AppConfig(engine={"max_slots": 6, "max_waiting": 10}, replicas=3, shutdown_timeout_s=120)
    options = config.replica_options(num_gpus=1)
    assert options["ray_actor_options"]["num_gpus"] == 1
    assert options["graceful_shutdown_timeout_s"] == config.replica_config(num_gpus=1).shutdown_timeout_s == 120
    assert options["max_ongoing_requests"] == 16 and options["num_replicas"] == 3
    scaled = AppConfig(autoscaling={"min_replicas": 1, "max_replicas": 5}).replica_options(num_gpus=0)
    assert "num_replicas" not in scaled and scaled["autoscaling_config"]["max_replicas"] == 5
    assert scaled["autoscaling_config"]["target_ongoing_requests"] == AppConfig().engine.max_slots
    assert config.replica_config(num_gpus=0).device == "cpu" and config.replica_config(num_gpus=1).device == "cuda"
    router = options["request_router_config"]  # the state-affinity router, fit to the engine
    assert router["request_router_class"] == "serve_app.router:StateAffinityRouter"
    assert router["request_router_kwargs"] == {"block_tokens": config.engine.cache_min_tokens, "slots": 6}
    assert "request_router_config" not in AppConfig(state_affinity=False).replica_options(num_gpus=0)
    for actor in (options["ray_actor_options"], config.ingress_options()["ray_actor_options"]):
        env = actor["runtime_env"]["env_vars"]
        assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    streaming = AppConfig(stream={"max_delay_ms": 50, "max_chunks_per_s": 250}).replica_config(num_gpus=0)
    assert (streaming.stream_delay_s, streaming.stream_chunks_per_s) == (0.05, 250)


def test_ingress_replicas_follow_the_slots_they_front():
    assert AppConfig(engine={"max_slots": 6}, replicas=3).ingress_options()["num_replicas"] == 1  # 18 streams
    big = {"engine": {"max_slots": 128, "max_waiting": 0}, "ingress_streams": 64}
    assert AppConfig(**big, replicas=3).ingress_options()["num_replicas"] == 6  # 384 streams
    assert AppConfig(**big, ingress_replicas=2).ingress_options()["num_replicas"] == 2  # set: taken as it is
    scaled = AppConfig(**big, autoscaling={"min_replicas": 0, "max_replicas": 5, "initial_replicas": 1})
    options = scaled.ingress_options()
    assert "num_replicas" not in options
    ingress = AutoscalingConfig(**options["autoscaling_config"])  # what Serve takes
    assert (ingress.min_replicas, ingress.initial_replicas, ingress.max_replicas) == (1, 2, 10)
    assert ingress.target_ongoing_requests == 64 and ingress.upscale_delay_s == scaled.autoscaling.upscale_delay_s
