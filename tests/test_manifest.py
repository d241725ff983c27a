"""`colo-data manifest`: the rendered Pathways JobSet and multi-controller Job are valid
Kubernetes objects (checked field by field against the kubernetes client's models, the
JobSet's and the KubeRay RayCluster's own fields by hand), share memory and sockets
between trainer and sidecar as the code expects, give the sidecar the CPU budget for the
expected workers, size shared memory from the batch, and use the images of
colo_data/versions.py; `[deploy] ray_nodes` adds a RayCluster whose head the host
pipelines' Ray workers point at; bad [deploy] values are errors naming the key; and the
version coupling agrees with the Dockerfile, pyproject and the deployment docs."""

from __future__ import annotations

import copy
import importlib.metadata
import inspect
import json
import math
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.utils import parse_quantity
from packaging.requirements import Requirement

from colo_data.config import Config, load_config
from colo_data.deploy import versions
from colo_data.deploy.manifest import RAY_CONNECT_TIMEOUT, SOCKET, parse_override, render
from colo_data.errors import ConfigError
from colo_data.runtime.budget import cpu_budget
from colo_data.workers.ray_options import RayWorkers
from colo_data.workers.settings import choose_workers, workers_from

ROOT = Path(__file__).resolve().parents[1]
COLO = Path(sys.executable).parent / "colo-data"
DEMO = ROOT / "configs" / "demo.toml"
SLICE = {"tpu_type": "v6e", "topology": "4x4", "gcs_scratch": "gs://bucket/pathways"}  # 4 hosts of 4 chips
API = client.ApiClient()
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# jobset.x-k8s.io/v1alpha2 fields (JobSetSpec, ReplicatedJob, Network, policies)
JOBSET_SPEC = {
    "replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy", "suspend",
    "coordinator", "managedBy", "ttlSecondsAfterFinished",
}
REPLICATED_JOB = {"name", "groupName", "template", "replicas", "dependsOn"}
# ray.io/v1 fields (RayClusterSpec, HeadGroupSpec, WorkerGroupSpec)
RAY_CLUSTER_SPEC = {
    "headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling", "autoscalerOptions",
    "headServiceAnnotations", "suspend", "managedBy", "gcsFaultToleranceOptions", "upgradeStrategy",
}
HEAD_GROUP = {"template", "rayStartParams", "serviceType", "headService", "enableIngress"}
WORKER_GROUP = {
    "groupName", "replicas", "minReplicas", "maxReplicas", "idleTimeoutSeconds", "rayStartParams", "template",
    "scaleStrategy", "suspend", "numOfHosts",
}


def write_config(tmp_path: Path, corpus: Path, text: str, **args: Any) -> Config:
    """A demo-pipeline config over `corpus` with `args` and the TOML tables in `text`."""
    values = {"data_dir": str(corpus), **args}
    lines = ['pipeline = "colo_data.demo:pipeline"', "[args]", *(f"{k} = {json.dumps(v)}" for k, v in values.items())]
    path = tmp_path / "deploy.toml"
    path.write_text("\n".join(lines) + "\n" + text)
    return load_config(path)


@pytest.fixture
def tiny(tmp_path: Path, token_corpus: Path) -> Config:
    """Small batches (6 rows a host of 2), 3 workers, 3 slots, its own shm dir and images."""
    return write_config(
        tmp_path, token_corpus,
        '[sidecar]\nworkers = 3\nslots = 3\nshm_dir = "/mnt/colo-shm"\n'
        '[deploy]\nname = "tiny"\nhosts = 2\nimage = "registry.example/colo-data-sidecar:1"\n'
        'trainer_image = "registry.example/trainer:1"\ncommand = ["python", "train.py"]\n',
        seq_len=8, global_batch_size=12,
    )


def strict(data: dict[str, Any], model: str) -> None:
    """`data` read as the kubernetes client's `model` and written back is `data` itself: a
    misspelled or misplaced field (which reading drops) or a wrong type fails."""
    if len(inspect.signature(API.deserialize).parameters) >= 3:  # kubernetes >= 37: (response, type, content type)
        value = API.deserialize(json.dumps(data), model, "application/json")
    else:  # kubernetes 36 (what pip picks beside moto: botocore needs python-dateutil < 3, kubernetes 37 >= 3)
        value = API.deserialize(SimpleNamespace(data=json.dumps(data)), model)
    assert API.sanitize_for_serialization(value) == data, f"not a valid {model}"


def check_jobset(jobset: dict[str, Any]) -> None:
    """A JobSet (a custom resource: no model in the client) checked by hand down to its
    Job templates, which are checked as V1JobTemplateSpec."""
    assert set(jobset) == {"apiVersion", "kind", "metadata", "spec"}
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    strict(jobset["metadata"], "V1ObjectMeta")
    spec = jobset["spec"]
    assert set(spec) <= JOBSET_SPEC, set(spec) - JOBSET_SPEC
    names = [job["name"] for job in spec["replicatedJobs"]]
    assert len(set(names)) == len(names)
    for job in spec["replicatedJobs"]:
        assert set(job) <= REPLICATED_JOB and {"name", "template"} <= set(job), job.keys()
        assert DNS_LABEL.fullmatch(job["name"])
        assert isinstance(job["replicas"], int) and job["replicas"] >= 1
        strict(job["template"], "V1JobTemplateSpec")
    assert spec["startupPolicy"] == {"startupPolicyOrder": "InOrder"}
    assert set(spec["failurePolicy"]) <= {"maxRestarts", "restartStrategy", "rules"}
    assert spec["failurePolicy"]["restartStrategy"] in ("Recreate", "BlockingRecreate")
    assert set(spec["network"]) <= {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"}
    assert all(isinstance(spec["network"][k], bool) for k in ("enableDNSHostnames", "publishNotReadyAddresses"))
    assert set(spec["coordinator"]) <= {"replicatedJob", "jobIndex", "podIndex"}
    assert spec["coordinator"]["replicatedJob"] in names
    assert spec["successPolicy"]["operator"] in ("All", "Any")
    assert set(spec["successPolicy"]["targetReplicatedJobs"]) <= set(names)


def check_ray_cluster(cluster: dict[str, Any]) -> None:
    """A KubeRay RayCluster (a custom resource: no model in the client) checked by hand
    down to its groups' pod templates, which are checked as V1PodTemplateSpec."""
    assert set(cluster) == {"apiVersion", "kind", "metadata", "spec"}
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    strict(cluster["metadata"], "V1ObjectMeta")
    spec = cluster["spec"]
    assert set(spec) <= RAY_CLUSTER_SPEC, set(spec) - RAY_CLUSTER_SPEC
    head, workers = spec["headGroupSpec"], spec["workerGroupSpecs"]
    assert set(head) <= HEAD_GROUP and "template" in head, head.keys()
    for group in workers:
        assert set(group) <= WORKER_GROUP and {"groupName", "template"} <= set(group), group.keys()
        assert DNS_LABEL.fullmatch(group["groupName"])
        counts = [group[k] for k in ("minReplicas", "replicas", "maxReplicas")]
        assert all(isinstance(n, int) and not isinstance(n, bool) for n in counts), counts
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert len({group["groupName"] for group in workers}) == len(workers)
    for group in [head, *workers]:
        params = group.get("rayStartParams", {})
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()), params  # map[string]string
        strict(group["template"], "V1PodTemplateSpec")


def ray_cluster(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The one RayCluster among rendered objects, checked."""
    (cluster,) = [o for o in objects if o["kind"] == "RayCluster"]
    check_ray_cluster(cluster)
    return cluster


def ray_pods(cluster: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The RayCluster's head container and its one worker group's container."""
    (group,) = cluster["spec"]["workerGroupSpecs"]
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    (worker,) = group["template"]["spec"]["containers"]
    return head, worker


def pod(job: dict[str, Any]) -> dict[str, Any]:
    """The pod spec of a Job or Job template."""
    return job["spec"]["template"]["spec"]


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """The container or init container `name` of a pod spec."""
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def env(c: dict[str, Any]) -> dict[str, str]:
    """A container's environment variables with plain values."""
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def mounts(c: dict[str, Any]) -> dict[str, str]:
    """A container's mount paths by volume name."""
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


def volume(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """The volume `name` of a pod spec."""
    return next(v for v in spec["volumes"] if v["name"] == name)


def pathways_worker(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The JobSet's replicated job of TPU hosts."""
    (jobset,) = objects
    return next(job for job in jobset["spec"]["replicatedJobs"] if job["name"] == "pathways-worker")


def test_demo_multi_controller_renders_valid_objects() -> None:
    service, job = render(load_config(DEMO), "multi-controller")
    strict(service, "V1Service")
    strict(job, "V1Job")
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 1
    assert pod(job)["subdomain"] == service["metadata"]["name"] == service["spec"]["selector"]["job-name"]
    assert service["spec"]["clusterIP"] == "None"


def test_demo_pathways_renders_a_valid_jobset() -> None:
    objects = render(load_config(DEMO), "pathways", SLICE)
    check_jobset(objects[0])
    head = next(job for job in objects[0]["spec"]["replicatedJobs"] if job["name"] == "pathways-head")
    trainer = container(pod(head["template"]), "trainer")
    assert env(trainer)["JAX_PLATFORMS"] == "proxy"
    assert trainer["command"] == ["colo-data", "bench", str(DEMO)]


@pytest.mark.parametrize(
    ("where", "change"),
    [
        ("job", lambda job: pod(job)["containers"][0].__setitem__("volumeMount", [])),  # misspelled
        ("job", lambda job: job["spec"].__setitem__("completions", "two")),  # wrong type
        ("jobset", lambda js: js["spec"].__setitem__("replicatedjobs", [])),  # misspelled JobSet field
        ("jobset", lambda js: pod(js["spec"]["replicatedJobs"][1]["template"]).__setitem__("initContainer", [])),
        ("ray", lambda rc: rc["spec"].__setitem__("workerGroupSpec", [])),  # misspelled RayCluster field
        ("ray", lambda rc: rc["spec"]["workerGroupSpecs"][0]["rayStartParams"].__setitem__("num-cpus", 4)),  # not a string
        ("ray", lambda rc: rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].__setitem__("resource", {})),
        ("ray", lambda rc: rc["spec"]["workerGroupSpecs"][0].__setitem__("minReplicas", 9)),  # above replicas
    ],
)
def test_the_schema_checks_catch_a_bad_field(where: str, change: Any) -> None:
    if where == "job":
        document = copy.deepcopy(render(load_config(DEMO), "multi-controller")[1])
        change(document)
        with pytest.raises(Exception):
            strict(document, "V1Job")
    elif where == "ray":
        document = copy.deepcopy(render(load_config(DEMO), "multi-controller", {"ray_nodes": 2})[2])
        check_ray_cluster(copy.deepcopy(document))
        change(document)
        with pytest.raises(AssertionError):
            check_ray_cluster(document)
    else:
        document = copy.deepcopy(render(load_config(DEMO), "pathways", SLICE)[0])
        change(document)
        with pytest.raises(AssertionError):
            check_jobset(document)


def test_multi_controller_shares_memory_and_the_socket(tiny: Config) -> None:
    service, job = render(tiny, "multi-controller")
    strict(job, "V1Job")
    spec = pod(job)
    sidecar, trainer = container(spec, "colo-data-sidecar"), container(spec, "trainer")
    assert sidecar["restartPolicy"] == "Always" and sidecar in spec["initContainers"]  # a native sidecar
    assert volume(spec, "colo-data-shm")["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Mi"}  # 10 small batches
    assert mounts(sidecar)["colo-data-shm"] == mounts(trainer)["colo-data-shm"] == "/mnt/colo-shm"
    assert env(sidecar)["COLO_DATA_SHM_DIR"] == env(trainer)["COLO_DATA_SHM_DIR"] == "/mnt/colo-shm"
    socket_dir = mounts(sidecar)["colo-data-socket"]
    assert mounts(trainer)["colo-data-socket"] == socket_dir
    # in a subdirectory of the world-writable emptyDir (the entrypoint makes it 0755): a trainer trusts that
    assert Path(SOCKET).parent.parent == Path(socket_dir)
    assert env(sidecar)["COLO_DATA_SOCKET"] == SOCKET and env(trainer)["COLO_DATA_SIDECAR"] == f"unix://{SOCKET}"
    assert sidecar["startupProbe"]["exec"]["command"] == ["test", "-S", SOCKET]
    assert (env(sidecar)["COLO_DATA_WORKERS"], env(sidecar)["COLO_DATA_SLOTS"]) == ("3", "3")
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    assert env(trainer)["JAX_COORDINATOR_ADDRESS"] == "tiny-0.tiny:8482"
    assert (sidecar["image"], trainer["image"]) == ("registry.example/colo-data-sidecar:1", "registry.example/trainer:1")
    assert trainer["command"] == ["python", "train.py"]


def test_multi_controller_on_tpus_takes_hosts_and_chips_from_the_topology(tiny: Config) -> None:
    _, job = render(tiny, "multi-controller", {"hosts": 4, "tpu_type": "v5p", "topology": "2x2x4"})
    strict(job, "V1Job")
    spec = pod(job)
    assert job["spec"]["completions"] == 4
    assert spec["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice", "cloud.google.com/gke-tpu-topology": "2x2x4",
    }
    assert container(spec, "trainer")["resources"] == {"limits": {"google.com/tpu": "4"}}
    with pytest.raises(ConfigError, match=r"\[deploy\] hosts = 2, but topology '2x2x4' has 4 TPU host"):
        render(tiny, "multi-controller", {"tpu_type": "v5p", "topology": "2x2x4"})


def test_pathways_shares_memory_between_worker_and_sidecar(tiny: Config) -> None:
    # tiny's 12-row batches do not split over 2 slices of 4 hosts: no measuring, give the size
    objects = render(tiny, "pathways", {**SLICE, "hosts": None, "slices": 2, "shm_size": "64Mi"})
    check_jobset(objects[0])
    worker = pathways_worker(objects)
    spec = pod(worker["template"])
    sidecar, server = container(spec, "colocated-python-sidecar"), container(spec, "pathways-worker")
    assert sidecar["restartPolicy"] == "Always" and sidecar in spec["initContainers"]
    assert volume(spec, "colo-data-shm")["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Mi"}
    assert mounts(sidecar)["colo-data-shm"] == mounts(server)["colo-data-shm"] == "/mnt/colo-shm"
    assert env(sidecar)["CLOUD_PATHWAYS_SIDECAR_SHM_DIRECTORY"] == env(server)["CLOUD_PATHWAYS_SIDECAR_SHM_DIRECTORY"]
    assert "--cloud_pathways_sidecar_shm_directory=/mnt/colo-shm" in server["args"]
    assert "--resource_manager_address=$(PATHWAYS_HEAD):29001" in server["args"]
    assert worker["replicas"] == 2 and worker["template"]["spec"]["completions"] == 4
    assert server["resources"]["limits"]["google.com/tpu"] == "4"
    head = pod(next(j for j in objects[0]["spec"]["replicatedJobs"] if j["name"] == "pathways-head")["template"])
    assert "--sidecar_name=external" in container(head, "pathways-proxy")["args"]
    assert "--instance_type=tpuv6e:4x4" in container(head, "pathways-rm")["args"]
    assert "--instance_count=2" in container(head, "pathways-rm")["args"]


def head_containers(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The JobSet's pathways-head pod's containers and init containers, by name."""
    (jobset,) = objects
    head = next(job for job in jobset["spec"]["replicatedJobs"] if job["name"] == "pathways-head")
    spec = pod(head["template"])
    return {c["name"]: c for c in spec["initContainers"] + spec["containers"]}


PROXY_ARGS = [
    "--server_port=29000", "--resource_manager_address=$(PATHWAYS_HEAD):29001",
    "--gcs_scratch_location=gs://bucket/pathways", "--sidecar_name=external",
]
FLAGS = ["--xla_tpu_enable_latency_hiding_scheduler=true", "--xla_dump_to=/tmp/xla", "--xla_tpu_use_enhanced_launch_barrier"]


@pytest.mark.parametrize("flags", [" ".join(FLAGS), FLAGS], ids=["string", "list"])
def test_pathways_xla_flags_are_the_proxys_args_not_the_trainers_environment(flags: Any) -> None:
    objects = render(load_config(DEMO), "pathways", {**SLICE, "xla_flags": flags})
    check_jobset(objects[0])
    containers = head_containers(objects)
    assert containers["pathways-proxy"]["args"] == PROXY_ARGS + FLAGS
    assert "--xla_dump_to=/tmp/xla" not in containers["pathways-rm"]["args"]
    assert not {"XLA_FLAGS", "LIBTPU_INIT_ARGS"} & set(env(containers["trainer"]))
    workers = pod(pathways_worker(objects)["template"])
    for c in workers["initContainers"] + workers["containers"]:
        assert not {"XLA_FLAGS", "LIBTPU_INIT_ARGS"} & set(env(c)) and not set(FLAGS) & set(c.get("args", [])), c["name"]


def test_pathways_trainer_is_told_where_the_compilation_cache_lives() -> None:
    """The servers' --gcs_scratch_location (their compilation cache is under it) reaches the
    trainer's environment, where `colo-data doctor` looks for it."""
    containers = head_containers(render(load_config(DEMO), "pathways", SLICE))
    assert f"--gcs_scratch_location={SLICE['gcs_scratch']}" in containers["pathways-proxy"]["args"]
    assert env(containers["trainer"])["COLO_DATA_PATHWAYS_SCRATCH"] == SLICE["gcs_scratch"]


def test_pathways_without_xla_flags_adds_none() -> None:
    for flags in ({}, {"xla_flags": ""}, {"xla_flags": []}):
        objects = render(load_config(DEMO), "pathways", {**SLICE, **flags})
        assert head_containers(objects)["pathways-proxy"]["args"] == PROXY_ARGS, flags


def test_xla_flags_from_the_deploy_table(tmp_path: Path, token_corpus: Path) -> None:
    table = '[deploy]\nxla_flags = ["--xla_a=1", "--xla_b"]\nshm_size = "64Mi"\n'
    config = write_config(tmp_path, token_corpus, table, seq_len=8, global_batch_size=16)
    assert head_containers(render(config, "pathways", SLICE))["pathways-proxy"]["args"] == PROXY_ARGS + ["--xla_a=1", "--xla_b"]


@pytest.mark.parametrize(
    ("deploy", "variable"), [({}, "XLA_FLAGS"), ({"tpu_type": "v5p", "topology": "2x2x4"}, "LIBTPU_INIT_ARGS")]
)
def test_multi_controller_xla_flags_are_the_trainers_environment(deploy: dict[str, Any], variable: str) -> None:
    """There the trainer compiles: XLA_FLAGS, or on TPU hosts libtpu's LIBTPU_INIT_ARGS."""
    _, job = render(load_config(DEMO), "multi-controller", {**deploy, "xla_flags": FLAGS})
    strict(job, "V1Job")
    trainer, sidecar = container(pod(job), "trainer"), container(pod(job), "colo-data-sidecar")
    assert env(trainer)[variable] == " ".join(FLAGS)
    assert not {"XLA_FLAGS", "LIBTPU_INIT_ARGS"} - {variable} & set(env(trainer))
    assert not {"XLA_FLAGS", "LIBTPU_INIT_ARGS"} & set(env(sidecar))
    _, job = render(load_config(DEMO), "multi-controller", deploy)
    assert not {"XLA_FLAGS", "LIBTPU_INIT_ARGS"} & set(env(container(pod(job), "trainer")))


@pytest.fixture
def tiny_without_hosts(tmp_path: Path, token_corpus: Path) -> Config:
    """Batches of 16 (2 rows a host on 2 slices of 4 hosts), no [deploy] table."""
    return write_config(tmp_path, token_corpus, '[sidecar]\nshm_dir = "/mnt/colo-shm"\n', seq_len=8, global_batch_size=16)


def test_pathways_defaults(tiny_without_hosts: Config) -> None:
    objects = render(tiny_without_hosts, "pathways", {**SLICE, "slices": 2})
    check_jobset(objects[0])
    spec = pod(pathways_worker(objects)["template"])
    sidecar, doctor = container(spec, "colocated-python-sidecar"), container(spec, "colo-data-doctor")
    assert sidecar["image"] == doctor["image"] == versions.SIDECAR_COLOCATED_IMAGE
    assert "command" not in sidecar and "args" not in sidecar  # the base image's colocated-Python server
    # the doctor runs first, as a plain init container, with the sidecar's limits and shm dir
    names = [c["name"] for c in spec["initContainers"]]
    assert names.index("colo-data-doctor") < names.index("colocated-python-sidecar") and "restartPolicy" not in doctor
    assert doctor["command"] == ["colo-data", "doctor"] and doctor["resources"] == sidecar["resources"]
    assert env(doctor)["COLO_DATA_SHM_DIR"] == "/mnt/colo-shm"
    assert {"name": "colo-data-shm", "mountPath": "/mnt/colo-shm"} in doctor["volumeMounts"]
    assert container(spec, "pathways-worker")["image"] == versions.PATHWAYS_SERVER_IMAGE
    head = pod(objects[0]["spec"]["replicatedJobs"][0]["template"])
    assert container(head, "pathways-rm")["image"] == versions.PATHWAYS_SERVER_IMAGE
    assert container(head, "pathways-proxy")["image"] == versions.PATHWAYS_PROXY_IMAGE
    assert container(head, "trainer")["image"] == versions.SIDECAR_IMAGE


def test_multi_controller_with_ray_nodes_adds_a_ray_cluster_for_the_sidecars(tmp_path: Path, token_corpus: Path) -> None:
    """`ray_nodes` adds a RayCluster (the objects of before unchanged but for the sidecar's
    workers) whose head service the sidecars' Ray workers point at; their CPU limit no
    longer grows with `[sidecar] workers`."""
    table = (
        '[sidecar]\nworkers = 6\n[deploy]\nname = "tiny"\nhosts = 2\nshm_size = "64Mi"\n'
        'image = "registry.example/colo-data-sidecar:1"\ncommand = ["python", "train.py"]\n'
    )
    config = write_config(tmp_path, token_corpus, table, seq_len=8, global_batch_size=12)
    service, job = render(config, "multi-controller")
    assert container(pod(job), "colo-data-sidecar")["resources"]["limits"]["cpu"] == "7"  # 6 workers + its own thread
    objects = render(config, "multi-controller", {"ray_nodes": 3, "ray_cpus": 2, "ray_memory": "6Gi"})
    assert [o["kind"] for o in objects] == ["Service", "Job", "RayCluster"]
    assert objects[0] == service
    strict(objects[1], "V1Job")
    cluster = ray_cluster(objects)
    assert cluster["metadata"]["name"] == "tiny-ray"
    head_group, (group,) = cluster["spec"]["headGroupSpec"], cluster["spec"]["workerGroupSpecs"]
    assert head_group["rayStartParams"]["num-cpus"] == "0"  # no actors on the head
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 3
    assert group["rayStartParams"] == {"num-cpus": "2"}
    head, worker = ray_pods(cluster)
    assert worker["resources"] == {"requests": {"cpu": "2", "memory": "6Gi"}, "limits": {"cpu": "2", "memory": "6Gi"}}
    assert head["resources"]["requests"] == head["resources"]["limits"]
    assert {"name": "client", "containerPort": 10001} in head["ports"]
    assert env(head) == {"GRPC_ENABLE_FORK_SUPPORT": "false"} and "env" not in worker  # Ray Client's server forks
    assert head["image"] == worker["image"] == "registry.example/colo-data-sidecar:1"  # the sidecar's Ray and Python
    assert "command" not in worker and "command" not in head  # KubeRay's `ray start`
    sidecar = container(pod(objects[1]), "colo-data-sidecar")
    workers = workers_from(env(sidecar)["COLO_DATA_WORKERS"], "COLO_DATA_WORKERS")
    assert workers == RayWorkers(address="ray://tiny-ray-head-svc:10001", actors=2, connect_timeout=RAY_CONNECT_TIMEOUT)
    assert sidecar["resources"]["limits"]["cpu"] == "4"  # the actors' CPUs are the cluster's
    assert container(pod(objects[1]), "trainer")["command"] == ["python", "train.py"]
    # the Job is the same else: only the sidecar's workers and limits differ
    for c in (sidecar, container(pod(job), "colo-data-sidecar")):
        del c["resources"]
        c["env"] = [e for e in c["env"] if e["name"] != "COLO_DATA_WORKERS"]
    assert objects[1] == job


def test_pathways_with_ray_nodes_adds_a_ray_cluster_and_gives_the_trainer_its_workers(tiny_without_hosts: Config) -> None:
    """Under Pathways the colocated sidecars take their workers from the trainer
    (cd.Colocated(workers=...)): the Ray workers are the trainer's COLO_DATA_WORKERS and
    the default command's --workers."""
    deploy = {**SLICE, "ray_nodes": 3, "ray_actors": 3, "ray_image": "registry.example/ray:1"}  # 4 hosts x 3 actors = 12 CPUs
    objects = render(tiny_without_hosts, "pathways", deploy)
    assert [o["kind"] for o in objects] == ["JobSet", "RayCluster"]
    check_jobset(objects[0])
    cluster = ray_cluster(objects)
    assert cluster["metadata"]["name"] == "colo-data-ray"
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["replicas"] == 3 and group["rayStartParams"] == {"num-cpus": "4"}
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    head, worker = ray_pods(cluster)
    assert worker["resources"]["limits"] == worker["resources"]["requests"] == {"cpu": "4", "memory": "8Gi"}
    assert head["image"] == worker["image"] == "registry.example/ray:1"
    trainer = head_containers(objects[:1])["trainer"]
    spec = env(trainer)["COLO_DATA_WORKERS"]
    workers = workers_from(spec, "COLO_DATA_WORKERS")
    assert isinstance(workers, RayWorkers)
    assert (workers.address, workers.actors) == ("ray://colo-data-ray-head-svc:10001", 3)
    assert trainer["command"] == ["colo-data", "bench", str(tiny_without_hosts.path), "--workers", spec]
    sidecar = container(pod(pathways_worker(objects[:1])["template"]), "colocated-python-sidecar")
    assert sidecar["resources"]["limits"]["cpu"] == "4"
    # the default image: the colocated sidecar's; a command of one's own is left as it is
    objects = render(tiny_without_hosts, "pathways", {**SLICE, "ray_nodes": 2, "command": ["python", "train.py"]})
    head, worker = ray_pods(ray_cluster(objects))
    assert head["image"] == worker["image"] == versions.SIDECAR_COLOCATED_IMAGE
    trainer = head_containers(objects[:1])["trainer"]
    assert trainer["command"] == ["python", "train.py"]
    assert workers_from(env(trainer)["COLO_DATA_WORKERS"], "COLO_DATA_WORKERS").address == "ray://colo-data-ray-head-svc:10001"


@pytest.mark.parametrize(
    ("target", "deploy"),
    [
        ("multi-controller", {}),
        ("multi-controller", {"ray_nodes": 0, "ray_cpus": 8, "ray_actors": 4}),  # 0: no cluster, the other keys kept
        ("pathways", SLICE),
        ("pathways", {**SLICE, "ray_nodes": 0}),
    ],
)
def test_without_ray_nodes_there_is_no_ray_cluster(target: str, deploy: dict[str, Any]) -> None:
    objects = render(load_config(DEMO), target, {**deploy, "shm_size": "64Mi"})
    assert [o["kind"] for o in objects] == (["Service", "Job"] if target == "multi-controller" else ["JobSet"])
    if target == "multi-controller":
        assert env(container(pod(objects[1]), "colo-data-sidecar"))["COLO_DATA_WORKERS"] == "auto"
    else:
        trainer = head_containers(objects)["trainer"]
        assert "COLO_DATA_WORKERS" not in env(trainer) and trainer["command"] == ["colo-data", "bench", str(DEMO)]


def test_the_longest_name_keeps_the_head_service_name_that_kuberay_makes() -> None:
    """KubeRay makes the head Service `<cluster>-head-svc` and cuts names over 50 characters;
    a name of 38 (an error above) would make it cut the one the sidecars are given."""
    name = "n" * 37
    _, job, cluster = render(load_config(DEMO), "multi-controller", {"name": name, "ray_nodes": 1, "shm_size": "64Mi"})
    service = f"{cluster['metadata']['name']}-head-svc"
    assert len(service) == 50
    address = workers_from(env(container(pod(job), "colo-data-sidecar"))["COLO_DATA_WORKERS"], "COLO_DATA_WORKERS").address
    assert address == f"ray://{service}:10001"


def test_ray_workers_of_the_config_reach_the_sidecar_as_their_spec(tmp_path: Path, token_corpus: Path) -> None:
    """`[sidecar] workers = { ray = ... }` is written as `--workers` reads it; a cluster of
    the manifest's own takes its place."""
    table = '[sidecar]\nworkers = { ray = "ray://ray-head:10001", actors = 4 }\n[deploy]\nshm_size = "64Mi"\n'
    config = write_config(tmp_path, token_corpus, table, seq_len=8, global_batch_size=12)
    _, job = render(config, "multi-controller")
    sidecar = container(pod(job), "colo-data-sidecar")
    assert workers_from(env(sidecar)["COLO_DATA_WORKERS"], "COLO_DATA_WORKERS") == RayWorkers("ray://ray-head:10001", actors=4)
    assert sidecar["resources"]["limits"]["cpu"] == "4"
    _, job, _ = render(config, "multi-controller", {"ray_nodes": 2})
    workers = workers_from(env(container(pod(job), "colo-data-sidecar"))["COLO_DATA_WORKERS"], "COLO_DATA_WORKERS")
    assert isinstance(workers, RayWorkers) and workers.address == "ray://colo-data-ray-head-svc:10001"


def test_large_batches_take_a_slot_each(tmp_path: Path, token_corpus: Path) -> None:
    """64 rows of 2**14 int32 tokens (4 MiB) plus `id` and `_index` (int64, 512 bytes each):
    one batch a slot of 4,195,328 bytes; 2 slots, doubled, is 16,781,312 bytes: 17 MiB."""
    config = write_config(tmp_path, token_corpus, "[sidecar]\nslots = 2\n", seq_len=2**14, global_batch_size=64)
    _, job = render(config, "multi-controller")
    assert volume(pod(job), "colo-data-shm")["emptyDir"]["sizeLimit"] == "17Mi"


def test_shared_memory_holds_the_ring_the_sidecar_plans(tiny: Config, tmp_path: Path) -> None:
    """The sidecar's own sizing (with plenty of room, so slots take their full 4 MiB) fits
    in half the volume: the other half is what lets it choose that size."""
    from colo_data.backends.sidecar.ring_plan import plan_ring

    _, job = render(tiny, "multi-controller")
    size = parse_quantity(volume(pod(job), "colo-data-shm")["emptyDir"]["sizeLimit"])
    plan = plan_ring(tiny.build(), str(tmp_path), slots=3, hosts=2)
    assert plan.per_slot > 1 and plan.needed <= size / 2


def test_explicit_shm_size_skips_the_measurement(tmp_path: Path) -> None:
    path = tmp_path / "remote.toml"
    path.write_text('pipeline = "colo_data.demo:pipeline"\n[args]\ndata_dir = "/nowhere"\n[deploy]\nshm_size = "3Gi"\n')
    _, job = render(load_config(path), "multi-controller")
    assert volume(pod(job), "colo-data-shm")["emptyDir"]["sizeLimit"] == "3Gi"
    sidecar = container(pod(job), "colo-data-sidecar")
    assert parse_quantity(sidecar["resources"]["limits"]["memory"]) == 3 * 2**30 + 4 * 2**30
    path.write_text('pipeline = "colo_data.demo:pipeline"\n[args]\ndata_dir = "/nowhere"\n')
    with pytest.raises(ConfigError, match=r"set \[deploy\] shm_size"):
        render(load_config(path), "multi-controller")


@pytest.mark.parametrize(
    ("sidecar", "deploy", "cpu", "workers"),
    [
        ('workers = "auto"', {}, "4", 64),
        ('workers = "auto"', {"sidecar_cpus": 2.5}, "2500m", 48),
        ('workers = "auto"', {"sidecar_cpus": 0.5}, "500m", 16),
        ('workers = "auto"', {"sidecar_cpus": 2}, "2", 32),
        ("workers = 6", {}, "7", 6),
        ("workers = 6", {"sidecar_cpus": 6.2}, "6200m", 6),
    ],
)
def test_sidecar_cpu_limit_gives_the_expected_workers(
    tmp_path: Path, token_corpus: Path, monkeypatch: pytest.MonkeyPatch,
    sidecar: str, deploy: dict[str, Any], cpu: str, workers: int,
) -> None:
    config = write_config(tmp_path, token_corpus, f"[sidecar]\n{sidecar}\n", seq_len=8, global_batch_size=12)
    _, job = render(config, "multi-controller", deploy)
    resources = container(pod(job), "colo-data-sidecar")["resources"]
    assert resources["limits"] == resources["requests"] and resources["limits"]["cpu"] == cpu
    # the budget the sidecar will find under that limit: its quota and a machine of 64 CPUs
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("COLO_DATA_CPUS", str(parse_quantity(cpu)))
    budget = cpu_budget(proc=str(tmp_path), root=str(tmp_path))
    monkeypatch.setattr("colo_data.workers.settings.memory_limit", lambda: 2**40)  # "auto": 16 a CPU, within the memory
    configured = config.sidecar["workers"]
    assert choose_workers(configured, budget).count == workers
    if configured != "auto":  # room for every worker beside the sidecar's own thread
        assert math.ceil(budget.cpus) >= workers + 1, budget


@pytest.mark.parametrize(
    ("target", "deploy", "message"),
    [
        ("multi-controller", {"name": "Bad_Name"}, r"\[deploy\] name = 'Bad_Name': give lower-case"),
        ("multi-controller", {"name": "x" * 41}, r"\[deploy\] name = 'x+': .*at most 40"),
        ("multi-controller", {"image": "a b"}, r"\[deploy\] image = 'a b': give an image reference"),
        ("multi-controller", {"command": "python train.py"}, r"\[deploy\] command = 'python train.py': give a non-empty list"),
        ("multi-controller", {"hosts": 0}, r"\[deploy\] hosts = 0: give an int >= 1"),
        ("multi-controller", {"hosts": True}, r"\[deploy\] hosts = True: give an int >= 1"),
        ("multi-controller", {"tpu_type": "v9", "topology": "2x2"}, r"\[deploy\] tpu_type = 'v9': give v5e, v5p, v6e, tpu7x"),
        ("multi-controller", {"tpu_type": "v6e"}, r"\[deploy\] tpu_type and topology: give both or neither"),
        ("multi-controller", {"tpu_type": "v6e", "topology": "2by2"}, r"\[deploy\] topology = '2by2'"),
        ("multi-controller", {"sidecar_cpus": -1}, r"\[deploy\] sidecar_cpus = -1: give a number of CPUs"),
        ("multi-controller", {"sidecar_memory": "lots"}, r"\[deploy\] sidecar_memory = 'lots': give a memory size"),
        ("multi-controller", {"shm_size": "1.5Gi"}, r"\[deploy\] shm_size = '1.5Gi': give a memory size"),
        ("multi-controller", {"shm_size": "1Gi", "sidecar_memory": "1Gi"}, r"\[deploy\] sidecar_memory = '1Gi' must exceed"),
        ("multi-controller", {"replicas": 2}, r"unknown key\(s\) \['replicas'\] in \[deploy\]"),
        ("multi-controller", {"slices": 2}, r"\[deploy\] slices = 2: multi-controller manifests are for one slice"),
        ("multi-controller", {"gcs_scratch": "gs://b"}, r"\[deploy\] gcs_scratch: used by --target pathways only"),
        ("pathways", {"gcs_scratch": "gs://b"}, r"\[deploy\] tpu_type is needed for --target pathways"),
        ("pathways", {**SLICE, "gcs_scratch": None}, r"\[deploy\] gcs_scratch is needed for --target pathways"),
        ("pathways", {**SLICE, "gcs_scratch": "s3://b"}, r"\[deploy\] gcs_scratch = 's3://b': give a Cloud Storage path"),
        ("pathways", {**SLICE, "hosts": 4}, r"\[deploy\] hosts: under Pathways"),
        ("pathways", {**SLICE, "slices": 0}, r"\[deploy\] slices = 0: give an int >= 1"),
        (
            "pathways", {**SLICE, "xla_flags": "--xla_a=1 xla_b=2"},
            r"\[deploy\] xla_flags = '--xla_a=1 xla_b=2': give flags \"--name=value\" or \"--name\" .*\('xla_b=2' is not one\)",
        ),
        ("pathways", {**SLICE, "xla_flags": ["--xla_a=1 --xla_b=2"]}, r"xla_flags = \['--xla_a=1 --xla_b=2'\]: .*is not one"),
        ("pathways", {**SLICE, "xla_flags": 3}, r"\[deploy\] xla_flags = 3: give flags \"--name=value\" or \"--name\""),
        ("multi-controller", {"xla_flags": "-xla_a"}, r"\[deploy\] xla_flags = '-xla_a': give flags .*\('-xla_a' is not one\)"),
        (
            "multi-controller", {"name": "n" * 38, "ray_nodes": 1},
            r"\[deploy\] name = 'n+': give at most 37 characters with ray_nodes: KubeRay shortens",
        ),
        ("multi-controller", {"ray_nodes": -1}, r"\[deploy\] ray_nodes = -1: give an int >= 0: the Ray worker pods"),
        ("multi-controller", {"ray_nodes": "2"}, r"\[deploy\] ray_nodes = '2': give an int >= 0"),
        ("multi-controller", {"ray_nodes": True}, r"\[deploy\] ray_nodes = True: give an int >= 0"),
        ("multi-controller", {"ray_nodes": 1, "ray_cpus": 0}, r"\[deploy\] ray_cpus = 0: give an int >= 1 \(Ray's num-cpus"),
        ("multi-controller", {"ray_nodes": 1, "ray_cpus": 2.5}, r"\[deploy\] ray_cpus = 2.5: give an int >= 1"),
        ("multi-controller", {"ray_nodes": 1, "ray_memory": "8GB"}, r"\[deploy\] ray_memory = '8GB': give a memory size"),
        ("multi-controller", {"ray_nodes": 1, "ray_image": "a b"}, r"\[deploy\] ray_image = 'a b': give an image reference"),
        ("multi-controller", {"ray_nodes": 1, "ray_actors": 0}, r"\[deploy\] ray_actors = 0: give an int >= 1 \(Ray actors"),
        (
            "multi-controller", {"ray_cpus": 8, "ray_image": "r/ray:1"},
            r"\[deploy\] ray_cpus, ray_image without ray_nodes: set ray_nodes",
        ),
        (
            "pathways", {**SLICE, "ray_nodes": 1},
            r"\[deploy\] ray_nodes = 1 of ray_cpus = 4 give 4 CPU\(s\), but 4 host pipeline\(s\) x ray_actors = 2 actor\(s\) "
            r"of 1 CPU need 8: set ray_nodes = 2, raise ray_cpus or lower ray_actors",
        ),
    ],
)
def test_bad_deploy_values_are_errors_naming_the_key(target: str, deploy: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        render(load_config(DEMO), target, {**deploy, "shm_size": deploy.get("shm_size", "64Mi")})
    assert str(error.value).startswith(f"{DEMO}: ") and "\n" not in str(error.value)


def test_workers_that_the_cpu_limit_cannot_give_are_an_error(tiny: Config) -> None:
    with pytest.raises(ConfigError, match=r"sidecar_cpus = 2 leaves CPUs for 1 worker process\(es\) .*, but \[sidecar\] workers = 3"):
        render(tiny, "multi-controller", {"sidecar_cpus": 2})


def test_unknown_target_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"target 'k8s': allowed: pathways, multi-controller"):
        render(load_config(DEMO), "k8s")


def test_a_deploy_table_is_read_and_must_be_a_table(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('pipeline = "m:f"\n[deploy]\nname = "x"\n')
    assert load_config(path).deploy == {"name": "x"}
    path.write_text('pipeline = "m:f"\ndeploy = 3\n')
    with pytest.raises(ConfigError, match=r"\[deploy\] must be a table"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "pair"),
    [
        ("sidecar_cpus=2.5", ("sidecar_cpus", 2.5)),
        ("hosts=4", ("hosts", 4)),
        ('command=["python", "t.py"]', ("command", ["python", "t.py"])),
        ("image=registry.example/colo:1", ("image", "registry.example/colo:1")),
        ('name="a-b"', ("name", "a-b")),
    ],
)
def test_overrides_parse_as_toml_values_else_text(text: str, pair: tuple[str, Any]) -> None:
    assert parse_override(text) == pair


def test_an_override_without_a_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match="give KEY=VALUE"):
        parse_override("hosts")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`colo-data manifest ARGS` through the installed console script, from the repository."""
    return subprocess.run([str(COLO), "manifest", *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize(
    ("target", "sets"),
    [
        ("multi-controller", ["--set", "hosts=2"]),
        ("multi-controller", ["--set", "hosts=2", "--set", "ray_nodes=1", "--set", "ray_memory=4Gi"]),
        ("pathways", ["--set", "tpu_type=v6e", "--set", "topology=2x2", "--set", "gcs_scratch=gs://bucket/p"]),
        (
            "pathways",
            ["--set", "tpu_type=v6e", "--set", "topology=2x2", "--set", "gcs_scratch=gs://bucket/p",
             "--set", "xla_flags=--xla_a=1 --xla_b"],
        ),
    ],
)
def test_cli_prints_the_rendered_yaml(target: str, sets: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    result = run_cli("configs/demo.toml", "--target", target, *sets)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("# colo-data manifest configs/demo.toml")
    printed = list(yaml.safe_load_all(result.stdout))
    overrides = dict(parse_override(text) for text in sets[1::2])
    assert printed == render(load_config("configs/demo.toml"), target, overrides)


def test_cli_errors_are_one_message() -> None:
    result = run_cli("configs/demo.toml", "--target", "pathways", "--set", "tpu_type=v9", "--set", "topology=2x2")
    assert result.returncode == 1 and result.stdout == ""
    assert "Error: configs/demo.toml: [deploy] tpu_type = 'v9'" in result.stderr and "Traceback" not in result.stderr


def test_versions_are_coupled() -> None:
    tag = versions.SIDECAR_BASE_IMAGE.rpartition(":")[2]
    assert tag.endswith(f"-jax_{versions.JAX_VERSION}")
    assert versions.PATHWAYS_SERVER_IMAGE.endswith(f"/server:jax-{versions.JAX_VERSION}")
    assert versions.PATHWAYS_PROXY_IMAGE.endswith(f"/proxy_server:jax-{versions.JAX_VERSION}")
    assert versions.SIDECAR_IMAGE == f"colo-data-sidecar:{importlib.metadata.version('colo-data')}"


def test_dockerfile_builds_on_the_base_image_of_versions() -> None:
    dockerfile = ROOT / "sidecar_image" / "Dockerfile"
    defaults = re.findall(r"^ARG BASE_IMAGE=(\S+)$", dockerfile.read_text(), re.MULTILINE)
    assert defaults == [versions.SIDECAR_BASE_IMAGE]
    # the two targets the manifests' default images name
    assert re.findall(r"^FROM \S+ AS (\w+)$", dockerfile.read_text(), re.MULTILINE) == ["colocated", "serve"]


def pinned(name: str) -> Requirement:
    """pyproject.toml's requirement on `name`."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [r for r in map(Requirement, dependencies) if r.name == name]
    return requirement


def test_pyproject_admits_the_pathwaysutils_of_versions() -> None:
    assert pinned("pathwaysutils").specifier.contains(versions.PATHWAYSUTILS_VERSION)


def test_pyproject_admits_the_jax_of_versions() -> None:
    assert pinned("jax").specifier.contains(versions.JAX_VERSION)


def test_the_deployment_docs_name_the_coupled_versions() -> None:
    page = (ROOT / "docs" / "deployment.md").read_text()
    for text in (versions.SIDECAR_BASE_IMAGE, f"JAX {versions.JAX_VERSION}", f"pathwaysutils {versions.PATHWAYSUTILS_VERSION}"):
        assert text in page, text
