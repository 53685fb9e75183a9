"""The deployment recipes in docs/deploy: the Kubernetes manifests pass the API schemas (strict, offline), the
Slurm script is valid bash, and every agent command in them is one the CLI accepts, with the pieces that
must agree (host-memory folder, secret, peers file, port, uid) agreeing."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest
import yaml

from agents.config import Settings
from ckpt.cli import build_parser
from procs import ROOT

DEPLOY = os.path.join(ROOT, "docs", "deploy")


def _docs() -> list[dict]:
    with open(os.path.join(DEPLOY, "kubernetes", "tierckpt.yaml")) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _kind(kind: str) -> dict:
    (doc,) = [d for d in _docs() if d["kind"] == kind]
    return doc


def test_every_kubernetes_manifest_passes_the_api_schema_strictly():
    kv = pytest.importorskip("kubernetes_validate")
    version = kv.latest_version()
    docs = _docs()
    assert {d["kind"] for d in docs} == {"Service", "StatefulSet", "DaemonSet", "Job"}
    for d in docs:
        kv.validate(d, version, strict=True)  # raises ValidationError naming the field


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of a container's args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], text)


def test_the_daemonset_runs_an_agent_command_the_cli_accepts_and_shares_its_folder_with_the_trainers():
    ds, job = _kind("DaemonSet"), _kind("Job")
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    # the node's address comes from the downward API, and is what the agent registers in etcd
    assert {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}} in agent["env"]
    args = [_expand(w, {"HOST_IP": "10.0.0.11"}) for w in agent["args"]]
    a = build_parser().parse_args(agent["command"][1:] + args)
    assert a.cmd == "agent" and a.node_rank == "auto" and a.etcd and a.cluster
    settings = Settings(shm=a.shm, etcd=a.etcd, cluster=a.cluster, nodes=a.nodes, advertise=a.advertise,
                        secret_file=a.secret_file).validate()
    assert settings.advertise == f"10.0.0.11:{agent['ports'][0]['containerPort']}"
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # resolves the etcd names
    mounts = {m["mountPath"]: m["name"] for m in agent["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "secret" in volumes[mounts[os.path.dirname(a.secret_file)]]
    shm_host = volumes[mounts[a.shm]]["hostPath"]["path"]
    tpod = job["spec"]["template"]["spec"]
    (trainer,) = tpod["containers"]
    tvol = {v["name"]: v for v in tpod["volumes"]}
    tmounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    assert tvol[tmounts[a.shm]]["hostPath"]["path"] == shm_host  # the trainers reach the agent's socket
    # the agent's socket admits only its own uid: agent and trainers run as the same user
    assert pod["securityContext"]["runAsUser"] == tpod["securityContext"]["runAsUser"]
    script = trainer["args"][0]
    for flag in ("--rdzv-backend c10d", "is_host=", "--local-addr"):
        assert flag in script
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in trainer["env"]
    assert job["spec"]["completions"] == a.nodes and f"--nnodes {a.nodes}" in script


def test_the_agents_etcd_endpoints_are_the_members_the_etcd_statefulset_starts():
    ds, sts, svc = _kind("DaemonSet"), _kind("StatefulSet"), _kind("Service")
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    a = build_parser().parse_args(agent["command"][1:] + [_expand(w, {"HOST_IP": "h"}) for w in agent["args"]])
    name, n = sts["metadata"]["name"], sts["spec"]["replicas"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
    client = {p["name"]: p["port"] for p in svc["spec"]["ports"]}["client"]
    members = [f"{name}-{i}.{svc['metadata']['name']}" for i in range(n)]
    assert a.etcd.split(",") == [f"http://{m}:{client}" for m in members]
    (etcd,) = sts["spec"]["template"]["spec"]["containers"]
    flags = dict(w[2:].split("=", 1) for w in etcd["args"])
    assert flags["initial-cluster"].split(",") == [f"{name}-{i}=http://{m}:2380" for i, m in enumerate(members)]
    assert flags["listen-client-urls"].endswith(f":{client}")
    assert n % 2 == 1  # a majority survives one member down


def _logical_lines(text: str) -> list[str]:
    return re.sub(r"\\\n\s*", " ", text).splitlines()


def test_the_slurm_script_is_valid_bash_and_its_agent_command_is_one_the_cli_accepts():
    path = os.path.join(DEPLOY, "slurm", "tierckpt.sbatch")
    subprocess.run(["bash", "-n", path], check=True)
    text = open(path).read()
    (line,) = [ln for ln in _logical_lines(text) if "ckpt agent" in ln]
    words = shlex.split(line[line.index("ckpt agent"):].rstrip("& "))
    subst = {"$CKPT_SHM": "/dev/shm/x", "$CKPT_DIR": "/shared", "$USER": "u", "$SLURM_JOB_NAME": "j"}
    words = [re.sub(r"\$\w+", lambda m: subst.get(m.group(0), "v"), w) for w in words]
    a = build_parser().parse_args(words[1:])
    assert a.cmd == "agent" and a.node_rank == "auto" and a.peers and a.secret_file
    assert "#SBATCH --ntasks-per-node=1" in text
    for flag in ("--rdzv-backend c10d", "is_host=", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "umask 077"):
        assert flag in text
