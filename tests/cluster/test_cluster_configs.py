"""The cluster configs operators run: Ray's own validators, the KubeRay manifest, their invariants.

`ray up` runs ``prepare_config`` and then ``validate_config`` (the autoscaler's
JSON schema, ray-schema.json) on a cluster YAML before it touches a machine;
these tests run the same functions on ray_configs/cluster.yaml and
ray_configs/cluster-aws.yaml, and ask the autoscaler's own bin-packing what it
would launch for GPU replicas. The RayService manifest is checked against a
schema of the CRD fields it uses (names taken from KubeRay's ray.io/v1 CRD),
its serveConfigV2 against Serve's ``ServeDeploySchema``, and its application
args against ``apps.builder.build_app``. `make e2e` runs cluster.yaml for real.
"""

from __future__ import annotations

import copy
import functools
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import tomllib
import yaml
from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
from ray.autoscaler._private.resource_demand_scheduler import (
    _default_utilization_scorer,
    get_nodes_for,
)
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import ServeDeploySchema

from apps.builder import build_app
from cli.ingress import DRAINING_DEFAULT_S, DRAINING_ENV, HAPROXY_ENV
from cluster.pending_requests import ROUTER_ENVIRONMENT
from scripts.e2e.check_serving import app_status, serve_url
from scripts.e2e.node_requirements import node_requirements
from scripts.e2e.render_config import loopback_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "ray_configs"
TOKEN_PATH = "~/.ray/auth_token"
NODE_REPO = "~/flotilla"
HEAD_PORTS = {"--port": 6379, "--dashboard-port": 8265, "--metrics-export-port": 8080}


def makefile_torch_pin() -> str:
    match = re.search(r"^TORCH\s*\?=\s*(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, "Makefile has no TORCH ?= pin"
    return match.group(1)


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / name).read_text())


def validated(config: dict[str, Any]) -> dict[str, Any]:
    """What `ray up` checks before it starts: Ray's defaults merged in, then Ray's schema."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def flags(command: str) -> dict[str, str]:
    """``--name=value`` flags of a shell command line."""
    return dict(arg.split("=", 1) for arg in shlex.split(command.replace(";", " ")) if arg.startswith("--") and "=" in arg)


def ray_start(commands: list[str]) -> str:
    (command,) = [c for c in commands if "ray start" in c]
    return command


# --- cluster.yaml (on-premises) and cluster-aws.yaml ----------------------------------------------


def test_local_config_passes_rays_validation_and_bootstrap() -> None:
    from ray.autoscaler._private.commands import _bootstrap_config

    config = load("cluster.yaml")
    prepared = validated(config)
    assert prepared["provider"]["type"] == "local"
    # Manual on-prem mode: one node type, min = max = the listed workers.
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["min_workers"] == node_type["max_workers"] == len(config["provider"]["worker_ips"])
    # The whole of `ray up`'s bootstrap short of SSH (local provider: no cloud calls).
    bootstrapped = _bootstrap_config(copy.deepcopy(config), no_config_cache=True)
    assert bootstrapped["provider"]["head_ip"] == config["provider"]["head_ip"]


def test_aws_config_passes_rays_validation_with_gpu_worker_types() -> None:
    prepared = validated(load("cluster-aws.yaml"))
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert head["resources"]["CPU"] == 0 and not head["resources"].get("GPU")
    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert {t["node_config"]["InstanceType"].split(".")[0] for t in gpu_types.values()} == {"g5", "p4d", "p5"}
    for name, node_type in gpu_types.items():
        assert node_type["min_workers"] == 0 < node_type["max_workers"], name
    assert sum(t["max_workers"] for t in gpu_types.values()) <= prepared["max_workers"]


def _nodes_for(demand: list[dict[str, Any]]) -> tuple[dict[str, int], list[Any]]:
    """What the autoscaler would launch on cluster-aws.yaml for ``demand`` (resource bundles)."""
    prepared = validated(load("cluster-aws.yaml"))
    scorer = functools.partial(_default_utilization_scorer,
                               node_availability_summary=NodeAvailabilitySummary(node_availabilities={}))
    to_add, residual = get_nodes_for(prepared["available_node_types"], {}, prepared["head_node_type"],
                                     prepared["max_workers"], demand, scorer)
    return dict(to_add), residual


def test_autoscaler_launches_gpu_nodes_for_gpu_replicas() -> None:
    # Two replicas: each a scheduler actor with one GPU plus its Serve replica (one CPU).
    replica: list[dict[str, Any]] = [{"CPU": 1, "GPU": 1}, {"CPU": 1}]
    assert _nodes_for(replica * 2) == ({"gpu-g5": 2}, [])
    # A replica pinned to H100s (scheduler_options: {accelerator_type: H100}) gets a p5.
    assert _nodes_for([{"CPU": 1, "GPU": 1, "accelerator_type:H100": 0.001}]) == ({"gpu-p5": 1}, [])
    # Demand past every type's max_workers is left pending, never over-launched.
    to_add, residual = _nodes_for([{"GPU": 1}] * 100)
    types = load("cluster-aws.yaml")["available_node_types"]
    assert residual and all(n <= types[name]["max_workers"] for name, n in to_add.items())


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-aws.yaml"])
def test_token_reaches_every_node_and_ray_requires_it(name: str) -> None:
    config = load(name)
    assert config["file_mounts"][TOKEN_PATH] == TOKEN_PATH
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        command = ray_start(config[key])
        assert re.search(r"(^|[;\s])RAY_AUTH_MODE=token (\S+=\S+ )*ray start ", command), (key, command)


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-aws.yaml"])
def test_every_node_starts_with_haproxy_s_direct_ingress_and_the_router_s_view(name: str) -> None:
    """What ``flotilla serve`` sets for the cluster it starts (cli.ingress), every node gets: Serve reads it
    in the controller, HAProxy's manager and each replica."""
    config = load(name)
    wanted = {**dict.fromkeys(HAPROXY_ENV[:2], "1"), **ROUTER_ENVIRONMENT, DRAINING_ENV: DRAINING_DEFAULT_S}
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assigned = dict(re.findall(r"(RAY_\w+)=(\S+)", ray_start(config[key])))
        assert {k: assigned.get(k) for k in wanted} == wanted, key


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-aws.yaml"])
def test_file_mounts_carry_every_package_and_what_make_install_needs(name: str) -> None:
    mounts = load(name)["file_mounts"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    for entry in [*packages, "pyproject.toml", "README.md", "Makefile"]:
        assert mounts.get(f"{NODE_REPO}/{entry}") == f"./{entry}", entry
        assert (ROOT / entry).exists(), entry
    assert f"make -C {NODE_REPO} install" in load(name)["setup_commands"]


def test_aws_config_installs_and_starts_like_the_local_one() -> None:
    local, aws = load("cluster.yaml"), load("cluster-aws.yaml")
    for key in ("file_mounts", "rsync_exclude", "setup_commands", "head_start_ray_commands",
                "worker_start_ray_commands"):
        assert aws[key] == local[key], key


def test_documented_ports_are_the_ones_ray_starts_with() -> None:
    config = load("cluster.yaml")
    head = flags(ray_start(config["head_start_ray_commands"]))
    assert {k: int(head[k]) for k in HEAD_PORTS} == HEAD_PORTS
    worker = flags(ray_start(config["worker_start_ray_commands"]))
    assert worker["--address"] == f"$RAY_HEAD_IP:{HEAD_PORTS['--port']}"
    assert int(worker["--metrics-export-port"]) == HEAD_PORTS["--metrics-export-port"]
    # The e2e talks to the head's dashboard and metrics ports.
    sandbox = (ROOT / "scripts" / "e2e" / "sandbox.sh").read_text()
    assert f"DASHBOARD=http://127.0.0.1:{HEAD_PORTS['--dashboard-port']}" in sandbox
    assert f"METRICS=http://127.0.0.1:{HEAD_PORTS['--metrics-export-port']}" in sandbox


# --- the e2e's helpers ------------------------------------------------------------------------------


def test_loopback_config_changes_only_where_the_node_is_and_still_validates() -> None:
    config = load("cluster.yaml")
    out = loopback_config(config, ssh_user="root", ssh_key="/k/id", cluster_name="e2e")
    assert out["provider"] == {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}
    assert out["auth"] == {"ssh_user": "root", "ssh_private_key": "/k/id"}
    changed = {k for k in config.keys() | out.keys() if config.get(k) != out.get(k)}
    assert changed == {"cluster_name", "provider", "auth"}
    assert validated(out)["available_node_types"]
    with pytest.raises(ValueError, match="local-provider"):
        loopback_config(load("cluster-aws.yaml"), ssh_user="u", ssh_key="k", cluster_name="c")


def test_node_requirements_are_the_makefiles_install() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pin = makefile_torch_pin()
    reqs = node_requirements(pyproject, pin)
    assert reqs[0] == pin
    assert set(pyproject["project"]["dependencies"]) <= set(reqs)
    assert set(pyproject["project"]["optional-dependencies"]["dev"]) <= set(reqs)
    assert set(pyproject["build-system"]["requires"]) <= set(reqs)


def test_check_serving_reads_status_and_url() -> None:
    status = {"applications": {"flotilla": {"status": "RUNNING", "message": ""}}}
    assert app_status(status, "flotilla") == ("RUNNING", "")
    assert app_status({"applications": {}}, "flotilla") == ("NOT_STARTED", "")
    assert serve_url(str(CONFIGS / "serve.yaml")).startswith("http://127.0.0.1:")


# --- KubeRay RayService -----------------------------------------------------------------------------

STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
QUANTITY_MAP = {"type": "object", "additionalProperties": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}
CONTAINER = {
    "type": "object",
    "required": ["name", "image"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "image": {"type": "string", "minLength": 1},
        "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
        "resources": {"type": "object", "additionalProperties": False,
                      "properties": {"requests": QUANTITY_MAP, "limits": QUANTITY_MAP}},
        "ports": {"type": "array", "items": {
            "type": "object", "required": ["containerPort"],
            "properties": {"containerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
                           "name": {"type": "string", "maxLength": 15}}}},
    },
}
POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "properties": {"spec": {"type": "object", "required": ["containers"], "properties": {
        "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
        "tolerations": {"type": "array", "items": {"type": "object"}}}}},
}
# Property names are those of KubeRay's ray.io/v1 CRD; additionalProperties=false catches a typo
# that the API server would silently drop.
RAYSERVICE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayService"},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}}},
        "spec": {
            "type": "object",
            "required": ["rayClusterConfig", "serveConfigV2"],
            "additionalProperties": False,
            "properties": {
                "serveConfigV2": {"type": "string"},
                "upgradeStrategy": {"type": "object", "additionalProperties": False, "properties": {
                    "type": {"enum": ["NewCluster", "NewClusterWithIncrementalUpgrade", "None"]},
                    "clusterUpgradeOptions": {"type": "object"}}},
                **{k: {} for k in ("deploymentUnhealthySecondThreshold", "excludeHeadPodFromServeSvc",
                                   "managedBy", "rayClusterDeletionDelaySeconds", "serveService",
                                   "serviceUnhealthySecondThreshold", "suspend")},
                "rayClusterConfig": {
                    "type": "object",
                    "required": ["headGroupSpec", "rayVersion"],
                    "additionalProperties": False,
                    "properties": {
                        "rayVersion": {"type": "string"},
                        "enableInTreeAutoscaling": {"type": "boolean"},
                        "authOptions": {"type": "object", "additionalProperties": False, "properties": {
                            "mode": {"enum": ["disabled", "token"]}, "secretName": {"type": "string"},
                            "enableK8sTokenAuth": {"type": "boolean"}}},
                        "autoscalerOptions": {"type": "object", "properties": {
                            "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
                            "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]}}},
                        "headGroupSpec": {"type": "object", "required": ["template"], "properties": {
                            "rayStartParams": STR_MAP, "template": POD_TEMPLATE}},
                        "workerGroupSpecs": {"type": "array", "items": {
                            "type": "object",
                            "required": ["groupName", "minReplicas", "maxReplicas", "template"],
                            "properties": {
                                "groupName": {"type": "string"},
                                "replicas": {"type": "integer", "minimum": 0},
                                "minReplicas": {"type": "integer", "minimum": 0},
                                "maxReplicas": {"type": "integer", "minimum": 1},
                                "rayStartParams": STR_MAP, "template": POD_TEMPLATE}}},
                        **{k: {} for k in ("gcsFaultToleranceOptions", "headServiceAnnotations",
                                           "historyServerOptions", "managedBy", "networkPolicy",
                                           "suspend", "tlsOptions", "upgradeStrategy")},
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    return yaml.safe_load((CONFIGS / "k8s" / "rayservice.yaml").read_text())


def test_rayservice_matches_the_crd_fields(rayservice: dict[str, Any]) -> None:
    jsonschema.validate(rayservice, RAYSERVICE_SCHEMA)
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"]["mode"] == "token"
    assert cluster["enableInTreeAutoscaling"] is True
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]


def test_rayservice_serve_config_is_a_serve_deploy_config(rayservice: dict[str, Any]) -> None:
    serve_config = ServeDeploySchema.model_validate(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    assert serve_config.http_options.host == "0.0.0.0"  # reachable through the serve Service
    (app,) = serve_config.applications
    assert app.import_path == "apps.builder:build_app"
    # One GPU per replica, and a worker pod has exactly the GPUs of one replica.
    (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == app.args["scheduler_options"]["num_gpus"]


def test_rayservice_app_args_build_the_application(rayservice: dict[str, Any]) -> None:
    """Every application's args build (unknown keys and bad values raise, naming the field) into the app
    they describe, and the deployment overrides name a deployment the app has."""
    for app in yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]:
        args = app["args"]
        deployment = build_app(args)._bound_deployment
        assert {d["name"] for d in app.get("deployments", [])} <= {deployment.name}
        (engine,) = deployment.init_args
        assert engine["model"] == args["model"] and engine["max_model_len"] == args["max_model_len"]
        assert deployment.init_kwargs["served_model_name"] == args["served_model_name"]
        assert deployment.init_kwargs["scheduler_options"] == args["scheduler_options"]
        config = deployment._deployment_config
        assert config.graceful_shutdown_timeout_s == args["graceful_shutdown_timeout_s"]
        autoscaling = config.autoscaling_config
        assert (autoscaling.min_replicas, autoscaling.max_replicas) == (args["autoscaling"]["min_replicas"],
                                                                        args["autoscaling"]["max_replicas"])
        slos = {k: v for k, v in args["autoscaling"].items() if k.startswith("slo_")}
        assert autoscaling.policy.policy_kwargs == slos
        if args.get("request_router", "prefix") != "default":  # the prefix router unless told otherwise
            assert config.request_router_config.request_router_class.endswith("PrefixAwareRequestRouter")


def test_image_pins_match_the_cluster_and_the_makefile() -> None:
    dockerfile = (CONFIGS / "k8s" / "Dockerfile").read_text()
    assert re.search(rf"^FROM rayproject/ray:{re.escape(ray.__version__)}-py311", dockerfile, re.M)
    assert f'"{makefile_torch_pin()}"' in dockerfile
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        name = package.rstrip("*")
        assert f"COPY --chown=ray:users {name} {name}" in dockerfile, name
