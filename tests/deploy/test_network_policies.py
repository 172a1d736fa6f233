"""The NetworkPolicies of deploy/k8s, read from what ``kubectl kustomize`` renders.

Egress (issue 10 item 13): a default deny covers every pod both ways; every
pod resolves names; each fleet process reaches only the stores it uses (in
dev the in-namespace Redis and Postgres pods, in prod the external stores'
address ranges) and flow code on the workers reaches what the labelled
allow-list ``fleet-flow-egress`` names: nothing by default, and an overlay
extends it for the workers alone. Ingress: Redis and Postgres accept only the
fleet processes that use them (and KEDA's operator, Postgres, with its component),
Flower's UI is open, the metrics port only to the scraper.

The analysis follows NetworkPolicy semantics: a pod selected by any policy of a
type is isolated for that direction, and what it may do is the union of the
rules of every policy that selects it.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
from k8s_kit import (
    K8S,
    OVERLAYS,
    POSTGRES_CLIENTS,
    REDIS_CLIENTS,
    Obj,
    build,
    configmap_data,
    egress_peers,
    kinds,
    one,
    render,
    schema_errors,
    selects,
    store_clients,
    workload_labels,
)

DNS = {"dns:UDP/53", "dns:TCP/53"}
# The prod overlay's external stores: documentation addresses (RFC 5737) an
# operator replaces with the real ranges (networkpolicy-prod.yaml).
PROD_REDIS, PROD_POSTGRES = "ip:192.0.2.10/32:TCP/6379", "ip:192.0.2.20/32:TCP/5432"
OPEN_CIDRS = ("0.0.0.0/0", "::/0")


def expected_egress(overlay: str) -> dict[str, set[str]]:
    """Every workload of ``overlay`` and exactly where it may connect."""
    redis = {PROD_REDIS} if overlay.startswith("prod") else {"redis:TCP/6379"}
    postgres = {PROD_POSTGRES} if overlay.startswith("prod") else {"postgres:TCP/5432"}
    both = DNS | redis | postgres
    expected = {"fleet-worker": both, "fleet-timers": both, "fleet-recovery": both,
                "fleet-attacher": both, "fleet-relay": both, "fleet-flower": both,
                "fleet-db-upgrade": DNS | postgres}
    if overlay == "dev":  # the stores themselves open no connection
        expected |= {"fleet-redis": set(DNS), "fleet-postgres": set(DNS)}
    return expected


def egress_errors(objs: list[Obj], expected: dict[str, set[str]]) -> list[str]:
    """What differs from ``expected``, and any rule that opens more than it names."""
    errors = []
    labels = workload_labels(objs)
    if set(labels) != set(expected):
        errors.append(f"workloads {sorted(labels)} are not {sorted(expected)}")
    for name, pod_labels in labels.items():
        peers = egress_peers(objs, pod_labels)
        if peers is None:
            errors.append(f"{name}: no Egress policy selects it: it may connect anywhere")
            continue
        if name in expected and peers != expected[name]:
            errors.append(f"{name}: egress {sorted(peers)}, expected {sorted(expected[name])}")
        for peer in peers:
            target, _, port = peer.rpartition(":")
            if target == "*" or port == "*":
                errors.append(f"{name}: {peer}: a rule without `to` or `ports` opens everything")
            if target.startswith("ip:") and target[3:].split("-")[0] in OPEN_CIDRS:
                errors.append(f"{name}: {peer}: the whole internet")
            if target.startswith("ns{*=*}"):
                errors.append(f"{name}: {peer}: every namespace")
    return errors


def default_deny(objs: list[Obj]) -> Obj:
    return one(objs, "NetworkPolicy", "fleet-default-deny")["spec"]  # type: ignore[no-any-return]


# -- egress -----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_default_deny_covers_every_pod_in_both_directions(overlay: str) -> None:
    objs = render(overlay)
    assert default_deny(objs) == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    for name, labels in workload_labels(objs).items():
        assert egress_peers(objs, labels) is not None, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_process_reaches_only_dns_and_the_stores_it_uses(overlay: str) -> None:
    assert egress_errors(render(overlay), expected_egress(overlay)) == []


def test_prod_names_the_external_stores_by_address_not_by_pod_label() -> None:
    for overlay in ("prod", "prod-keda"):
        objs = render(overlay)
        for policy, port in (("fleet-redis-egress", 6379), ("fleet-postgres-egress", 5432)):
            (rule,) = one(objs, "NetworkPolicy", policy)["spec"]["egress"]
            assert [set(peer) for peer in rule["to"]] == [{"ipBlock"}], (overlay, policy)
            assert rule["ports"] == [{"port": port, "protocol": "TCP"}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_flow_allow_list_is_labelled_empty_and_selects_only_the_workers(
        overlay: str) -> None:
    objs = render(overlay)
    policy = one(objs, "NetworkPolicy", "fleet-flow-egress")
    assert policy["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    assert policy["spec"]["policyTypes"] == ["Egress"]
    assert policy["spec"]["egress"] == []
    chosen = [name for name, labels in workload_labels(objs).items()
              if selects(policy["spec"]["podSelector"], labels)]
    assert chosen == ["fleet-worker"]


def test_an_overlay_extends_the_flow_allow_list_for_the_workers_alone(tmp_path: Path) -> None:
    """The documented way to let flow code call out: a patch of fleet-flow-egress."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    mine = tree / "overlays" / "mine"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(textwrap.dedent("""\
        apiVersion: kustomize.config.k8s.io/v1beta1
        kind: Kustomization
        resources:
          - ../prod
        patches:
          - path: flow-egress.yaml
        """))
    (mine / "flow-egress.yaml").write_text(textwrap.dedent("""\
        apiVersion: networking.k8s.io/v1
        kind: NetworkPolicy
        metadata:
          name: fleet-flow-egress
        spec:
          egress:
            - to:
                - ipBlock:
                    cidr: 203.0.113.0/24
              ports:
                - protocol: TCP
                  port: 443
        """))
    objs = build(mine)
    expected = expected_egress("prod")
    expected["fleet-worker"] = expected["fleet-worker"] | {"ip:203.0.113.0/24:TCP/443"}
    assert egress_errors(objs, expected) == []
    assert schema_errors(objs, "1.35") == []


def test_the_egress_check_catches_a_policy_that_opens_too_much() -> None:
    objs = render("prod")
    one(objs, "NetworkPolicy", "fleet-flow-egress")["spec"]["egress"] = [{}]
    redis = one(objs, "NetworkPolicy", "fleet-redis-egress")["spec"]
    redis["egress"][0]["to"].append({"ipBlock": {"cidr": "0.0.0.0/0"}})
    # A worker Deployment relabelled out of the Postgres policy loses the store.
    pg = one(objs, "NetworkPolicy", "fleet-postgres-egress")["spec"]["podSelector"]
    pg["matchExpressions"][1]["values"].remove("timers")
    errors = egress_errors(objs, expected_egress("prod"))
    for expected in ("fleet-worker: *:*: a rule without `to` or `ports` opens everything",
                     "fleet-attacher: ip:0.0.0.0/0:TCP/6379: the whole internet",
                     "fleet-timers: egress"):
        assert any(e.startswith(expected) for e in errors), (expected, errors)
    # No Egress policy at all: every pod is free to connect anywhere.
    bare = [o for o in render("dev") if o["kind"] != "NetworkPolicy"]
    assert any("may connect anywhere" in e for e in egress_errors(bare, expected_egress("dev")))


# -- ingress ----------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_fleet_reaches_redis_and_postgres(overlay: str) -> None:
    objs = render(overlay)
    # KEDA's operator reads the backlog from Postgres (decision 0046), nothing from Redis.
    keda = {"namespace:keda"} if overlay == "prod-keda" else set()
    assert store_clients(objs, {"app.kubernetes.io/name": "redis"}, 6379) == REDIS_CLIENTS
    assert store_clients(objs, {"app.kubernetes.io/name": "postgres"}, 5432) == (
        POSTGRES_CLIENTS | keda)


METRICS_SERVED = {"fleet-flower", "fleet-timers", "fleet-recovery", "fleet-attacher",
                  "fleet-relay"}
# Prometheus in the namespace `monitoring`: the one peer of the metrics port.
SCRAPER = {"from": [{"namespaceSelector": {"matchLabels": {
    "kubernetes.io/metadata.name": "monitoring"}}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prometheus"}}}],
    "ports": [{"port": 9100, "protocol": "TCP"}]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_flowers_ui_is_the_only_port_a_fleet_process_opens(overlay: str) -> None:
    objs = render(overlay)
    for name, labels in workload_labels(objs).items():
        if labels.get("app.kubernetes.io/name") != "fleet":
            continue  # the dev stores: test_only_the_fleet_reaches_redis_and_postgres
        rules = [rule for p in kinds(objs, "NetworkPolicy")
                 if "Ingress" in p["spec"]["policyTypes"]
                 and selects(p["spec"]["podSelector"], labels)
                 for rule in p["spec"].get("ingress", [])]
        if name == "fleet-flower":
            assert rules == [{"ports": [{"port": 5555, "protocol": "TCP"}]}, SCRAPER]
        elif name in METRICS_SERVED:
            # Each service's /metrics: its process metrics, for the scraper alone.
            assert rules == [SCRAPER], name
        else:
            assert rules == [], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_metrics_port_is_open_to_the_scraper_alone_and_flowers_is_the_scrape_target(
        overlay: str) -> None:
    """Issue 28 item 7 (decision 0046): the fleet's metrics have no password of their
    own, so only Prometheus reaches the port; Flower's pod is the one annotated target
    for them, on the port the ConfigMap gives FLEET_METRICS_PORT."""
    objs = render(overlay)
    port = int(configmap_data(objs)["FLEET_METRICS_PORT"])
    assert port == 9100
    for name, labels in workload_labels(objs).items():
        if name in METRICS_SERVED:
            assert store_clients(objs, labels, port) == {"namespace:monitoring"}, name
    flower = one(objs, "Deployment", "fleet-flower")
    template = flower["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    (main,) = template["spec"]["containers"]
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in main["ports"]
    service_ports = [p["port"] for p in one(objs, "Service", "fleet-flower")["spec"]["ports"]]
    assert service_ports == [5555]  # the scraper reaches the pod, not a Service
