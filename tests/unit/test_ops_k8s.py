"""ops/k8s: every manifest parses, the Kubernetes kinds pass kubernetes-validate --strict (schemas shipped in
the pip package, offline), and the KEDA ScaledObject scales the worker Deployment on a Prometheus query of the
exporter's queue gauges. KEDA's own CRD schema is not shipped by any validator installed here: checked by hand."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml")  # PyYAML comes with kubernetes-validate (the test group); a bare unit env skips

K8S = pathlib.Path(__file__).resolve().parents[2] / "ops" / "k8s"


def _docs() -> dict[tuple[str, str], dict]:  # type: ignore[type-arg]
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[(doc["kind"], doc["metadata"]["name"] if "metadata" in doc else path.name)] = doc
    return out


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files


def test_kubernetes_kinds_pass_the_schemas() -> None:
    tool = pathlib.Path(sys.executable).with_name("kubernetes-validate")
    exe = str(tool) if tool.exists() else shutil.which("kubernetes-validate")
    if exe is None:
        pytest.skip("needs kubernetes-validate (pip install kubernetes-validate)")
    files = [str(p) for p in sorted(K8S.glob("*.yaml")) if p.name not in ("kustomization.yaml", "scaledobject.yaml")]
    out = subprocess.run([exe, "--strict", *files], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("passed") >= 9


def test_scaled_object_scales_the_workers_on_queue_depth() -> None:
    docs = _docs()
    so = docs[("ScaledObject", "worker")]
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    spec = so["spec"]
    assert spec["scaleTargetRef"]["name"] == "worker" and ("Deployment", "worker") in docs
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert set(meta) >= {"serverAddress", "query", "threshold"}
    assert "rollpool_queue_depth" in meta["query"] and float(meta["threshold"]) > 0
    assert all(isinstance(v, str) for v in meta.values())  # KEDA trigger metadata is a map of strings


def test_workers_request_a_gpu_and_dial_the_broker_service() -> None:
    docs = _docs()
    worker = docs[("Deployment", "worker")]["spec"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "tcp://rollpool-broker:5555" in worker["args"]
    assert ("Service", "rollpool-broker") in docs and ("DaemonSet", "relay") in docs


def test_curve_component_mounts_only_each_roles_key_files(tmp_path: pathlib.Path) -> None:
    """`components: [curve]` renders (kubectl kustomize, offline) one Secret per role, mounted in the keys layout."""
    import base64
    import os

    from rollpool.cli.keys import generate
    from rollpool.protocol.roles import HOST_FILES

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("needs kubectl (for kustomize)")
    base = tmp_path / "k8s"
    shutil.copytree(K8S, base, ignore=shutil.ignore_patterns("keys"))
    generate(str(base / "curve" / "keys"))
    with open(base / "kustomization.yaml", "a") as f:
        f.write("components:\n  - curve\n")
    out = subprocess.run([kubectl, "kustomize", str(base)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    for kind, name, host in (("Deployment", "broker", "broker"), ("Deployment", "worker", "worker"), ("DaemonSet", "relay", "relay")):
        (w,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
        pod = w["spec"]["template"]["spec"]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "curve-keys"]
        secret = secrets[vol["secret"]["secretName"]]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["ROLLPOOL_CURVE_DIR"] == "/etc/rollpool/keys"
        # materialize the mount and compare it with what `rollpool keys gen` says to ship to this host
        mount = tmp_path / f"mount-{name}"
        for item in vol["secret"]["items"]:
            path = mount / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(base64.b64decode(secret["data"][item["key"]]))
        expected = set()
        for entry in HOST_FILES[host]:
            src = base / "curve" / "keys" / entry
            expected |= {str(p.relative_to(base / "curve" / "keys")) for p in src.rglob("*.key")} if entry.endswith("/") else {entry}
        got = {str(p.relative_to(mount)) for p in mount.rglob("*") if p.is_file()}
        assert got == expected, (name, got ^ expected)
        for rel in got:
            assert (mount / rel).read_bytes() == (base / "curve" / "keys" / rel).read_bytes()
        assert ("server.key_secret" in got) == (host != "worker")
        assert not any(rel.endswith("key_secret") and not rel.startswith((host, "server")) for rel in got)
        assert os.path.isdir(mount / "allowed") == (host != "worker")


def test_multi_gpu_component_gives_each_worker_the_gpus_of_its_engine(tmp_path: pathlib.Path) -> None:
    """`components: [multi-gpu]` renders a worker asking for 2 GPUs and running a tp_size 2 engine on them."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("needs kubectl (for kustomize)")
    base = tmp_path / "k8s"
    shutil.copytree(K8S, base, ignore=shutil.ignore_patterns("keys"))
    with open(base / "kustomization.yaml", "a") as f:
        f.write("components:\n  - multi-gpu\n")
    out = subprocess.run([kubectl, "kustomize", str(base)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    (worker,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment" and d["metadata"]["name"] == "worker"]
    container = worker["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus == "2"
    assert int(env["ROLLPOOL_TP_SIZE"]) * int(env["ROLLPOOL_DP_SIZE"]) == int(gpus)
    assert "ROLLPOOL_WORKER_ID" in env  # the base's env is kept
