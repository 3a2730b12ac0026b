"""deploy/kuberay: the RayJob, the shared PVC and the Kueue objects fit together."""

from __future__ import annotations

import shlex
from pathlib import Path

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
