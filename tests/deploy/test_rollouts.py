"""Rollouts and disruptions in the rendered overlays (issue 28 item 4, decision 0049).

Rendered with ``kubectl kustomize`` like ``test_manifests.py``: every component
that runs more than one pod has a PodDisruptionBudget and spreads over zones as
well as hosts; the example flow is dev's, never prod's; KEDA's autoscaler scales
up and down by explicit rules, as the base HPA does. A negative check for each
rule proves it can fail.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from k8s_kit import OVERLAYS, configmap_data, kinds, one, pod_template, render, selects

Obj = dict[str, Any]
ZONE, HOST = "topology.kubernetes.io/zone", "kubernetes.io/hostname"


def _scaled(objs: list[Obj]) -> set[str]:
    """Deployments an autoscaler (HPA or KEDA) sizes."""
    names = {o["spec"]["scaleTargetRef"]["name"] for o in kinds(objs, "HorizontalPodAutoscaler")}
    return names | {o["spec"]["scaleTargetRef"]["name"] for o in kinds(objs, "ScaledObject")}


def disruption_errors(objs: list[Obj]) -> list[str]:
    errors: list[str] = []
    scaled = _scaled(objs)
    pdbs = kinds(objs, "PodDisruptionBudget")
    for obj in kinds(objs, "Deployment"):
        name = obj["metadata"]["name"]
        if obj["spec"].get("replicas", 1) < 2 and name not in scaled:
            continue
        labels = pod_template(obj)["metadata"]["labels"]
        if not any(selects(p["spec"]["selector"], labels) for p in pdbs):
            errors.append(f"{name}: no PodDisruptionBudget")
        spread = pod_template(obj)["spec"].get("topologySpreadConstraints", [])
        keys = {c["topologyKey"] for c in spread if selects(c["labelSelector"], labels)}
        errors += [f"{name}: no spread over {key}" for key in (ZONE, HOST) if key not in keys]
    return errors


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_multi_replica_component_has_a_pdb_and_spreads_over_zones_and_hosts(
        overlay: str) -> None:
    objs = render(overlay)
    assert disruption_errors(objs) == []
    assert one(objs, "PodDisruptionBudget", "fleet-attacher")["spec"]["maxUnavailable"] == 1


def test_the_disruption_check_catches_a_missing_budget_and_spread() -> None:
    objs = copy.deepcopy(render("prod"))
    objs = [o for o in objs if not (o["kind"] == "PodDisruptionBudget"
                                    and o["metadata"]["name"] == "fleet-attacher")]
    timers = pod_template(one(objs, "Deployment", "fleet-timers"))["spec"]
    timers["topologySpreadConstraints"] = [c for c in timers["topologySpreadConstraints"]
                                           if c["topologyKey"] != ZONE]
    assert sorted(disruption_errors(objs)) == ["fleet-attacher: no PodDisruptionBudget",
                                               "fleet-timers: no spread over " + ZONE]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_example_flow_runs_in_dev_only(overlay: str) -> None:
    flows = configmap_data(render(overlay))["FLEET_FLOWS"]
    assert flows
    if overlay == "dev":
        assert flows == "fleet.examples.onboarding:onboard"
    else:
        assert "fleet.examples" not in flows, flows


def test_keda_scales_up_and_down_by_explicit_rules() -> None:
    rendered = render("prod-keda")
    for each in kinds(rendered, "ScaledObject"):  # the workers' and the timers'
        rules = each["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert set(rules) == {"scaleUp", "scaleDown"}, each["metadata"]["name"]
    scaled = one(rendered, "ScaledObject", "fleet-worker")
    behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa_behavior = one(render("prod"), "HorizontalPodAutoscaler", "fleet-worker")["spec"][
        "behavior"]
    assert behavior == hpa_behavior  # the same rules, whichever autoscaler runs
