"""Rendering deploy/k8s with ``kubectl kustomize`` and reading what it rendered.

Shared by the deploy tests: ``render(overlay)`` (cached, a fresh copy each
call), ``build(directory)`` for a tree a test changed, label selectors as the
API server evaluates them, and what the NetworkPolicies let in and out.
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

Obj = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "prod", "prod-keda")
K8S_VERSIONS = ("1.30", "1.31", "1.32", "1.33", "1.34", "1.35")
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("keda.sh/v1alpha1", "TriggerAuthentication")}
WORKLOADS = ("Deployment", "StatefulSet", "Job")
UID = 10001
# The command each component runs (after the image's `fleet` entrypoint).
COMMANDS = {"worker": ["worker", "--queues", "$(FLEET_QUEUE)",
                       "--concurrency", "$(FLEET_WORKER_DRIVES)"],
            "timers": ["timers"], "recovery": ["recovery"], "attacher": ["attacher"],
            "relay": ["relay"], "flower": ["flower"], "db-upgrade": ["db", "upgrade"]}
HEALTH_CHECKED = ("worker", "timers", "recovery", "attacher", "relay")
REDIS_CLIENTS = {"worker", "timers", "recovery", "attacher", "relay", "flower"}
POSTGRES_CLIENTS = {"worker", "timers", "recovery", "attacher", "relay", "flower",
                    "db-upgrade"}
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|KEY|AUTH|CREDENTIAL|_URL$", re.I)
CREDENTIALS_IN_URL = re.compile(r"://[^/\s]*:[^/\s]*@")


def kubectl() -> str:
    """kubectl's path; a missing one fails the test (kustomize is the renderer)."""
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl (with its built-in kustomize >= 5) renders deploy/k8s: install "
                    "it (Debian/Ubuntu: the kubectl package, or https://dl.k8s.io)")
    return found


def build(directory: Path) -> list[Obj]:
    """``kubectl kustomize directory``: the objects ``kubectl apply -k`` would apply."""
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        pytest.fail(f"kubectl kustomize {directory} failed:\n{done.stderr}")
    return [o for o in yaml.safe_load_all(done.stdout) if o]


@functools.cache
def _render(overlay: str) -> tuple[Obj, ...]:
    return tuple(build(K8S / "overlays" / overlay))


def render(overlay: str) -> list[Obj]:
    """The overlay's objects (a copy: a test may change them)."""
    return copy.deepcopy(list(_render(overlay)))


def kinds(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def component(obj: Obj) -> str:
    return str(pod_template(obj)["metadata"]["labels"].get("app.kubernetes.io/component"))


def pod_template(obj: Obj) -> Obj:
    return obj["spec"]["template"]  # type: ignore[no-any-return]


def containers(pod_spec: Obj) -> Iterator[Obj]:
    yield from pod_spec.get("initContainers", [])
    yield from pod_spec.get("containers", [])


def configmap_data(objs: list[Obj]) -> dict[str, str]:
    (config,) = (o for o in kinds(objs, "ConfigMap")
                 if o["metadata"]["name"].startswith("fleet-config-"))
    return config["data"]  # type: ignore[no-any-return]


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if ((op == "In" and value not in expr["values"])
                or (op == "NotIn" and value in expr["values"])
                or (op == "Exists" and value is None)
                or (op == "DoesNotExist" and value is not None)):
            return False
    return True


@functools.cache
def secret_example() -> dict[str, dict[str, str]]:
    docs = yaml.safe_load_all((K8S / "secret.example.yaml").read_text())
    return {d["metadata"]["name"]: d["stringData"] for d in docs if d}


def store_clients(objs: list[Obj], store_labels: dict[str, str], port: int) -> set[str]:
    """Who the NetworkPolicies let reach a pod labelled ``store_labels`` on ``port``.

    Fleet components by name; another namespace as ``namespace:<name>``; a rule
    with no ``from`` (anyone) as ``*``.
    """
    admitted: set[str] = set()
    for policy in kinds(objs, "NetworkPolicy"):
        if not selects(policy["spec"]["podSelector"], store_labels):
            continue
        for rule in policy["spec"].get("ingress", []):
            if not any(p.get("port") == port for p in rule.get("ports", [{"port": port}])):
                continue
            if "from" not in rule:
                admitted.add("*")
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    ns = peer["namespaceSelector"].get("matchLabels", {})
                    admitted.add(f"namespace:{ns.get('kubernetes.io/metadata.name', '*')}")
                elif "podSelector" in peer:
                    admitted |= {component(o) for o in objs if o["kind"] in WORKLOADS
                                 and selects(peer["podSelector"],
                                             pod_template(o)["metadata"]["labels"])}
                else:
                    admitted.add("*")
    return admitted


# Peers the egress analysis names by what they are rather than by selector.
_NAMED_PEERS = {
    (("kubernetes.io/metadata.name", "kube-system"),): {(("k8s-app", "kube-dns"),): "dns"},
    (): {(("app.kubernetes.io/name", "redis"),): "redis",
         (("app.kubernetes.io/name", "postgres"),): "postgres"},
}


def _peer(peer: Obj) -> str:
    """One ``to`` entry: ``dns``, ``redis``, ``postgres``, ``ip:<cidr>[-except]`` or a
    ``pods{...}`` / ``ns{...}/pods{...}`` description of any other selector."""
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        excepts = ",".join(block.get("except", []))
        return f"ip:{block['cidr']}" + (f"-{excepts}" if excepts else "")
    ns = peer.get("namespaceSelector")
    pods = peer.get("podSelector", {})
    if (ns is not None and set(ns) - {"matchLabels"}) or set(pods) - {"matchLabels"}:
        return f"selector:{peer}"
    ns_key = tuple(sorted((ns or {}).get("matchLabels", {}).items()))
    pod_key = tuple(sorted(pods.get("matchLabels", {}).items()))
    if ns is not None and not ns_key:
        ns_key = (("*", "*"),)  # namespaceSelector {}: every namespace
    named = _NAMED_PEERS.get(ns_key, {}).get(pod_key)
    if named is not None:
        return named
    where = "ns{" + ",".join(f"{k}={v}" for k, v in ns_key) + "}/" if ns is not None else ""
    return where + "pods{" + ",".join(f"{k}={v}" for k, v in pod_key) + "}"


def egress_peers(objs: list[Obj], pod_labels: dict[str, str]) -> set[str] | None:
    """Where the NetworkPolicies let a pod labelled ``pod_labels`` connect to.

    ``"<peer>:<protocol>/<port>"`` strings (``*`` for any peer or port), or None
    when no policy of type Egress selects the pod: then nothing limits it.
    Egress is the union of the rules of every policy that selects the pod
    (NetworkPolicy semantics); a policy with no rules only isolates.
    """
    isolated, allowed = False, set()
    for policy in kinds(objs, "NetworkPolicy"):
        spec = policy["spec"]
        if "Egress" not in spec.get("policyTypes", []) or not selects(spec["podSelector"],
                                                                        pod_labels):
            continue
        isolated = True
        for rule in spec.get("egress", []):
            ports = [f"{p.get('protocol', 'TCP')}/{p.get('port', '*')}"
                     for p in rule.get("ports", [])] or ["*"]
            peers = [_peer(p) for p in rule.get("to", [])] or ["*"]
            allowed |= {f"{peer}:{port}" for peer in peers for port in ports}
    return allowed if isolated else None


def workload_labels(objs: list[Obj]) -> dict[str, dict[str, str]]:
    """Each workload's pod labels, by workload name."""
    return {o["metadata"]["name"]: pod_template(o)["metadata"]["labels"]
            for o in objs if o["kind"] in WORKLOADS}


def schema_errors(objs: list[Obj], version: str) -> list[str]:
    """kubernetes-validate --strict against ``version``; CRDs must be in CRD_KINDS."""
    errors = []
    for obj in objs:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            checked = kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            errors.append(f"{name} ({version}): {path}: {exc.message}")
            continue
        except SchemaNotFoundError:
            if (obj["apiVersion"], obj["kind"]) not in CRD_KINDS:
                errors.append(f"{name} ({version}): no schema for {obj['apiVersion']}")
            continue
        if checked != version:
            errors.append(f"{name}: validated against {checked}, not {version}")
    return errors
