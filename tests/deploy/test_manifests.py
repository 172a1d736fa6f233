"""deploy/k8s renders and validates offline, for Kubernetes 1.30 to 1.35.

- **Render.** Each overlay is built by ``kubectl kustomize`` (kustomize 5
  inside kubectl, on every machine that runs this suite): what ``kubectl apply
  -k`` would apply, not a re-implementation of it. No kubectl fails the run,
  with what to install; it never skips.
- **Schemas.** Every object is checked by ``kubernetes_validate.validate(obj,
  version, strict=True)``: the library behind ``kubernetes-validate --strict``,
  which ships the JSON schemas of each Kubernetes minor it supports inside its
  wheel (nothing is downloaded). Strict means an unknown field is an error,
  which is how a misspelt field shows up. KEDA's custom resources have no
  schema there: they are listed in ``CRD_KINDS`` and checked by the policy
  tests below instead.
- **Policy.** What a schema cannot say: requests and limits, probes and the
  security context on every container; no secret value in a manifest, and
  every Secret reference present in ``secret.example.yaml``; no secret on any
  process's command line (container argv, probes, hooks); images by digest in
  prod; selectors that
  select their pods; the autoscaler on the worker Deployment; the schema gate
  before pods start; a grace period longer than the lease. (NetworkPolicies:
  ``test_network_policies.py``.)
- **A broken manifest fails**: ``test_a_broken_manifest_fails`` breaks a copy
  of the tree and watches the same checks refuse it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from k8s_kit import (
    COMMANDS,
    CRD_KINDS,
    CREDENTIALS_IN_URL,
    HEALTH_CHECKED,
    K8S,
    K8S_VERSIONS,
    OVERLAYS,
    POSTGRES_CLIENTS,
    REDIS_CLIENTS,
    ROOT,
    SECRET_NAME,
    UID,
    WORKLOADS,
    Obj,
    build,
    component,
    configmap_data,
    containers,
    kinds,
    kubectl,
    one,
    pod_template,
    render,
    schema_errors,
    secret_example,
    selects,
    store_clients,
)
from kubernetes_validate.utils import all_versions

from fleet.config import FleetSettings

# -- the checks (each returns what is wrong, so a test can also feed it a broken object) ---


def container_errors(objs: list[Obj]) -> list[str]:
    """Requests, limits, probes and the security context of every container."""
    errors = []
    for obj in (o for o in objs if o["kind"] in WORKLOADS):
        pod = pod_template(obj)["spec"]
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        pod_sc = pod.get("securityContext", {})
        if pod_sc.get("runAsNonRoot") is not True:
            errors.append(f"{where}: pod securityContext.runAsNonRoot is not true")
        if pod_sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            errors.append(f"{where}: pod seccompProfile is not RuntimeDefault")
        if pod.get("automountServiceAccountToken") is not False:
            errors.append(f"{where}: mounts a service account token")
        for c in containers(pod):
            at = f"{where} container {c['name']}"
            for kind in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    if resource not in c.get("resources", {}).get(kind, {}):
                        errors.append(f"{at}: no {resource} in resources.{kind}")
            sc = c.get("securityContext", {})
            expected = {"runAsNonRoot": True, "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False}
            errors += [f"{at}: securityContext.{k} is not {v}" for k, v in expected.items()
                       if sc.get(k) is not v]
            if not isinstance(sc.get("runAsUser"), int) or sc["runAsUser"] == 0:
                errors.append(f"{at}: securityContext.runAsUser is not a non-root uid")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                errors.append(f"{at}: capabilities do not drop ALL")
            if sc.get("capabilities", {}).get("add") or sc.get("privileged"):
                errors.append(f"{at}: adds capabilities or is privileged")
            if sc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
                errors.append(f"{at}: seccompProfile is not RuntimeDefault")
            is_init = c in pod.get("initContainers", [])
            if obj["kind"] != "Job" and not is_init:
                errors += [f"{at}: no {p}" for p in ("livenessProbe", "readinessProbe")
                           if p not in c]
    return errors


def secret_errors(objs: list[Obj]) -> list[str]:
    """No Secret object or secret-looking literal; every reference is in the example."""
    errors = [f"Secret/{o['metadata']['name']} is inlined" for o in kinds(objs, "Secret")]
    example = secret_example()
    for cm in kinds(objs, "ConfigMap"):
        for key, value in cm.get("data", {}).items():
            if SECRET_NAME.search(key) or CREDENTIALS_IN_URL.search(value):
                errors.append(f"ConfigMap {cm['metadata']['name']}: {key} looks secret")
    refs: list[tuple[str, str, str]] = []
    for obj in (o for o in objs if o["kind"] in WORKLOADS):
        for c in containers(pod_template(obj)["spec"]):
            at = f"{obj['metadata']['name']}/{c['name']}"
            for env in c.get("env", []):
                if "value" in env and (SECRET_NAME.search(env["name"])
                                       or CREDENTIALS_IN_URL.search(env["value"])):
                    errors.append(f"{at}: {env['name']} has a literal value")
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.append((at, ref["name"], ref["key"]))
            errors += [f"{at}: envFrom a whole Secret ({s['secretRef']['name']}): name keys"
                       for s in c.get("envFrom", []) if "secretRef" in s]
        for volume in pod_template(obj)["spec"].get("volumes", []):
            if "secret" in volume and volume["secret"]["secretName"] not in example:
                errors.append(f"{obj['metadata']['name']}: volume {volume['name']}: Secret "
                              f"{volume['secret']['secretName']} is not in secret.example.yaml")
    for auth in kinds(objs, "TriggerAuthentication"):
        refs += [(auth["metadata"]["name"], r["name"], r["key"])
                 for r in auth["spec"]["secretTargetRef"]]
    for at, name, key in refs:
        if key not in example.get(name, {}):
            errors.append(f"{at}: Secret {name} key {key} is not in secret.example.yaml")
    return errors


# A flag whose next word (or =value) is a secret, as tools spell it.
SECRET_FLAGS = re.compile(r"(^|\s)(--requirepass|--masterauth|--pass|--password|-a|--auth|"
                          r"--basic-auth|--broker|--url|--dsn)(=|\s+)\S", re.I)
SECRET_ASSIGNMENT = re.compile(r"\b\w*(PASSWORD|SECRET|TOKEN|_AUTH)\w*=\S", re.I)


def command_lines(pod_spec: Obj) -> Iterator[tuple[str, list[str]]]:
    """Every argv a pod's containers run: command + args, exec probes, lifecycle hooks."""
    for c in containers(pod_spec):
        yield c["name"], [*c.get("command", []), *c.get("args", [])]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if "exec" in c.get(probe, {}):
                yield f"{c['name']} {probe}", c[probe]["exec"]["command"]
        for hook in ("postStart", "preStop"):
            handler = c.get("lifecycle", {}).get(hook, {})
            if "exec" in handler:
                yield f"{c['name']} {hook}", handler["exec"]["command"]


def argv_secret_errors(objs: list[Obj]) -> list[str]:
    """No secret on a process command line (``ps`` and /proc show every argv to
    anyone on the node, and it outlives the process in shell history and audit logs).

    A secret-sourced environment variable must not be expanded into an argv
    (Kubernetes' ``$(VAR)``) nor named in a shell script's text (``$VAR`` ends up
    in a child's argv); no credentials in a URL; no password flag with a value.
    """
    errors = []
    for obj in (o for o in objs if o["kind"] in WORKLOADS):
        pod = pod_template(obj)["spec"]
        for c in containers(pod):
            secret_vars = {e["name"] for e in c.get("env", [])
                           if "secretKeyRef" in e.get("valueFrom", {})}
            for where, argv in command_lines({"containers": [c]}):
                at = f"{obj['metadata']['name']}/{where}"
                text = " ".join(argv)
                for var in sorted(secret_vars):
                    if re.search(rf"\$\(?{{?{var}\b", text):
                        errors.append(f"{at}: puts the secret ${var} on a command line")
                if CREDENTIALS_IN_URL.search(text):
                    errors.append(f"{at}: credentials in a URL on a command line")
                if SECRET_FLAGS.search(text) or SECRET_ASSIGNMENT.search(text):
                    errors.append(f"{at}: a password flag or assignment on a command line")
    return errors


def selector_errors(objs: list[Obj]) -> list[str]:
    errors = []
    pods = [(o, pod_template(o)["metadata"].get("labels", {}))
            for o in objs if o["kind"] in WORKLOADS]
    for obj in (o for o in objs if o["kind"] in ("Deployment", "StatefulSet")):
        if not selects(obj["spec"]["selector"], pod_template(obj)["metadata"]["labels"]):
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: selector misses its pods")
        others = [o for o, labels in pods
                  if o is not obj and selects(obj["spec"]["selector"], labels)]
        errors += [f"{obj['metadata']['name']}: selector also selects {o['metadata']['name']}"
                   for o in others]
    for pdb in kinds(objs, "PodDisruptionBudget"):
        chosen = [o["metadata"]["name"] for o, labels in pods
                  if selects(pdb["spec"]["selector"], labels)]
        if chosen != [pdb["metadata"]["name"]]:
            errors.append(f"PodDisruptionBudget/{pdb['metadata']['name']} selects {chosen}")
    for svc in kinds(objs, "Service"):
        if not any(selects({"matchLabels": svc["spec"]["selector"]}, labels)
                   for _, labels in pods):
            errors.append(f"Service/{svc['metadata']['name']} selects no pod")
    return errors


# -- the validator and the renderer ---------------------------------------------------


def test_the_validator_ships_every_schema_offline() -> None:
    shipped = {v.rsplit(".", 1)[0] for v in all_versions()}
    schemas = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    for version in K8S_VERSIONS:
        assert version in shipped, f"kubernetes-validate has no schemas for {version}"
        strict = schemas / f"v{version}.0-local-strict"
        assert (strict / "deployment-apps-v1.json").is_file(), strict


def test_kubectl_kustomize_is_version_5_or_later() -> None:
    """The manifests use kustomize 5 features (``labels``, components, ``patches``)."""
    done = subprocess.run([kubectl(), "version", "--client", "--output=json"],
                          capture_output=True, text=True, check=True, timeout=60)
    version = json.loads(done.stdout)["kustomizeVersion"]
    assert re.fullmatch(r"v(\d+)\.\d+\.\d+.*", version), version
    assert int(version[1:].split(".")[0]) >= 5, version


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_strictly(overlay: str, version: str) -> None:
    objs = render(overlay)
    assert schema_errors(objs, version) == []
    validated = [o for o in objs if (o["apiVersion"], o["kind"]) not in CRD_KINDS]
    assert len(validated) >= 15


def test_a_broken_manifest_fails(tmp_path: Path) -> None:
    """A misspelt field and a wrong type in a copy of the base, rendered through dev."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    worker, timers = tree / "base" / "worker.yaml", tree / "base" / "timers.yaml"
    text = worker.read_text()
    typo = text.replace('imagePullPolicy: IfNotPresent\n          args: ["worker"',
                        'imagePulPolicy: IfNotPresent\n          args: ["worker"')
    assert typo.count("imagePulPolicy") == 1
    worker.write_text(typo)
    timers.write_text(timers.read_text().replace("replicas: 2", "replicas: two"))
    objs = build(tree / "overlays" / "dev")
    for version in K8S_VERSIONS:
        errors = schema_errors(objs, version)
        assert len(errors) == 2, errors
        assert any(e.startswith("Deployment/fleet-worker") and "spec.template.spec.containers.0"
                   in e and "'imagePulPolicy' was unexpected" in e for e in errors), errors
        assert any(e.startswith("Deployment/fleet-timers") and "spec.replicas: 'two'" in e
                   for e in errors), errors
    # Only --strict catches the misspelling: without it the unknown field passes.
    deployment = one(objs, "Deployment", "fleet-worker")
    assert kubernetes_validate.validate(deployment, "1.35", strict=False) == "1.35"


def test_the_policy_checks_catch_a_broken_pod() -> None:
    objs = render("prod")
    worker = one(objs, "Deployment", "fleet-worker")
    pod = pod_template(worker)["spec"]
    main = pod["containers"][0]
    del main["resources"]["limits"]
    del main["livenessProbe"]
    main["securityContext"]["allowPrivilegeEscalation"] = True
    main["env"].append({"name": "FLEET_REDIS_URL", "value": "redis://:hunter2@redis:6379/0"})
    worker["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] = "workers"
    objs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "leaked"},
                 "stringData": {"password": "hunter2"}})
    errors = container_errors(objs) + secret_errors(objs) + selector_errors(objs)
    for expected in ("no cpu in resources.limits", "no memory in resources.limits",
                     "no livenessProbe", "allowPrivilegeEscalation is not False",
                     "FLEET_REDIS_URL has a literal value", "Secret/leaked is inlined",
                     "fleet-worker: selector misses its pods"):
        assert any(expected in e for e in errors), (expected, errors)


# -- policy, per overlay ---------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_have_resources_probes_and_a_locked_down_context(overlay: str) -> None:
    assert container_errors(render(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_is_inlined_and_every_reference_is_documented(overlay: str) -> None:
    assert secret_errors(render(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_secret_is_on_a_process_command_line(overlay: str) -> None:
    objs = render(overlay)
    assert argv_secret_errors(objs) == []
    argvs = [argv for o in objs if o["kind"] in WORKLOADS
             for _, argv in command_lines(pod_template(o)["spec"])]
    assert len(argvs) >= 12  # every container, exec probe and gate was looked at


def test_the_command_line_check_catches_a_password_in_argv() -> None:
    """What the dev Redis did before (``--requirepass $(REDIS_PASSWORD)``), and its kin."""
    objs = render("dev")
    pod = pod_template(one(objs, "StatefulSet", "fleet-redis"))["spec"]
    redis = pod["containers"][0]
    redis["args"] = ["--appendonly", "yes", "--requirepass", "$(REDIS_PASSWORD)"]
    redis["env"] = [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
        "name": "fleet-secrets", "key": "redis-password"}}}]
    redis["readinessProbe"]["exec"]["command"] = ["sh", "-c", "redis-cli -a hunter2 ping"]
    worker = pod_template(one(objs, "Deployment", "fleet-worker"))["spec"]
    worker["containers"][0]["args"] += ["--broker=redis://worker:hunter2@fleet-redis:6379/0"]
    gate = worker["initContainers"][0]
    gate["args"] = [gate["args"][0] + 'psql "$FLEET_DATABASE_URL" -c "select 1"\n']
    job = pod_template(one(objs, "Job", "fleet-db-upgrade"))["spec"]["containers"][0]
    job["command"] = ["sh", "-c", "PGPASSWORD=hunter2 fleet db upgrade"]
    errors = argv_secret_errors(objs)
    for expected in ("fleet-redis/redis: puts the secret $REDIS_PASSWORD on a command line",
                     "fleet-redis/redis: a password flag",
                     "fleet-redis/redis readinessProbe: a password flag",
                     "fleet-worker/worker: credentials in a URL",
                     "fleet-worker/wait-for-schema: puts the secret $FLEET_DATABASE_URL",
                     "fleet-db-upgrade/db-upgrade: a password flag or assignment"):
        assert any(e.startswith(expected) for e in errors), (expected, errors)


def test_the_secret_example_holds_only_placeholders() -> None:
    example = secret_example()
    assert set(example) == {"fleet-secrets", "fleet-redis-acl", "fleet-keda-postgres"}
    for name, data in example.items():
        for key, value in data.items():
            if name != "fleet-keda-postgres" or key == "password":  # the rest: no secret
                assert "CHANGE_ME" in value, (name, key)
    for kustomization in K8S.rglob("kustomization.yaml"):
        text = yaml.safe_load(kustomization.read_text())
        listed = text.get("resources", []) + [p["path"] for p in text.get("patches", [])]
        assert not any("secret" in entry for entry in listed), kustomization


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_select_their_own_pods(overlay: str) -> None:
    assert selector_errors(render(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_processes_run_their_command_and_their_own_health_check(overlay: str) -> None:
    objs = render(overlay)
    seen = set()
    for obj in (o for o in objs if o["kind"] in WORKLOADS and o["metadata"]["name"]
                not in ("fleet-redis", "fleet-postgres")):
        name = component(obj)
        seen.add(name)
        main = pod_template(obj)["spec"]["containers"][0]
        assert main["args"] == COMMANDS[name], obj["metadata"]["name"]
        if name in HEALTH_CHECKED:
            # HTTP probes served by the process (fleet.services.probes), never exec:
            # an exec probe starts an interpreter each time (issue 28 item 4).
            ports = {p["name"]: p["containerPort"] for p in main.get("ports", [])}
            assert ports["health"] == int(configmap_data(objs)["FLEET_HEALTH_PORT"]), name
            for probe in ("startupProbe", "readinessProbe"):
                assert main[probe]["httpGet"] == {"path": "/readyz", "port": "health"}, (
                    name, probe)
            # Liveness asks only the process's own loop: a store outage must not
            # restart every pod.
            assert main["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "health"}
        for c in pod_template(obj)["spec"]["containers"]:
            if name in HEALTH_CHECKED or name == "flower":
                assert not any("exec" in c.get(p, {}) for p in
                               ("startupProbe", "livenessProbe", "readinessProbe")), name
    assert seen == set(COMMANDS)
    # With KEDA, its ScaledObject owns the timers' count (2 at least).
    timers = one(objs, "Deployment", "fleet-timers")["spec"]
    assert timers.get("replicas", 2) == 2
    assert ("replicas" in timers) == (overlay != "prod-keda")
    assert one(objs, "Deployment", "fleet-recovery")["spec"]["replicas"] == 2
    # Two relays: one publishes (the lease), the other is ready to take over.
    assert one(objs, "Deployment", "fleet-relay")["spec"]["replicas"] == 2
    assert one(objs, "PodDisruptionBudget", "fleet-relay")["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_are_fleet_settings_and_every_reference_resolves(
        overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    objs = render(overlay)
    known = {f"FLEET_{name.upper()}" for name in FleetSettings.model_fields}
    data = configmap_data(objs)
    assert set(data) <= known, set(data) - known
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in kinds(objs, "ConfigMap")}
    for obj in (o for o in objs if o["kind"] in WORKLOADS):
        for c in containers(pod_template(obj)["spec"]):
            names = {e["name"] for e in c.get("env", [])}
            assert {n for n in names if n.startswith("FLEET_")} <= known, c["name"]
            for source in c.get("envFrom", []):
                names |= set(configmaps[source["configMapRef"]["name"]])
            used = re.findall(r"\$\((\w+)\)", " ".join(c.get("command", []) + c.get("args", [])))
            assert set(used) <= names, (obj["metadata"]["name"], c["name"], used)
    # The values parse: the processes would start with this configuration.
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    settings = FleetSettings()
    assert settings.queue == data["FLEET_QUEUE"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_grace_period_outlasts_the_lease(overlay: str) -> None:
    objs = render(overlay)
    lease_s = int(configmap_data(objs).get("FLEET_LEASE_MS", 30_000)) / 1000
    worker = pod_template(one(objs, "Deployment", "fleet-worker"))["spec"]
    assert worker["terminationGracePeriodSeconds"] >= lease_s + 10
    strategy = one(objs, "Deployment", "fleet-worker")["spec"]["strategy"]
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_wait_for_the_schema_the_job_applies(overlay: str) -> None:
    objs = render(overlay)
    for obj in kinds(objs, "Deployment"):
        spec = pod_template(obj)["spec"]
        uses_store = any(e.get("valueFrom", {}).get("secretKeyRef", {}).get("key")
                         == "database-url" for c in spec["containers"] for e in c.get("env", []))
        if not uses_store:
            continue
        (gate,) = spec["initContainers"]
        assert gate["name"] == "wait-for-schema"
        assert "until fleet db status --check; do" in gate["args"][0]
        assert gate["image"] == spec["containers"][0]["image"]
    job = one(objs, "Job", "fleet-db-upgrade")
    annotations = job["metadata"]["annotations"]
    assert annotations["argocd.argoproj.io/hook"] == "PreSync"
    assert annotations["argocd.argoproj.io/hook-delete-policy"] == "BeforeHookCreation"
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    # A PreSync hook runs before the sync creates this render's ConfigMap: read none.
    assert "configMap" not in json.dumps(job)


DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def image_errors(objs: list[Obj], *, by_digest: bool) -> list[str]:
    """Every image pinned (a tag that is not ``latest``, or a digest); with
    ``by_digest``, every image must name its digest."""
    errors = []
    for obj in (o for o in objs if o["kind"] in WORKLOADS):
        for c in containers(pod_template(obj)["spec"]):
            image, at = c["image"], f"{obj['metadata']['name']}/{c['name']}"
            if "@" in image:
                if not DIGEST.search(image):
                    errors.append(f"{at}: {image}: not a sha256 digest")
                continue
            if by_digest:
                errors.append(f"{at}: {image}: a tag, not a digest")
            name, _, tag = image.rpartition(":")
            if not name or "/" in tag or tag == "latest":
                errors.append(f"{at}: {image}: not pinned")
    return errors


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned_and_one_version_per_rollout(overlay: str) -> None:
    objs = render(overlay)
    assert image_errors(objs, by_digest=overlay != "dev") == []
    images = {c["image"] for o in objs if o["kind"] in WORKLOADS
              for c in containers(pod_template(o)["spec"])}
    fleet = {i for i in images if i.split(":")[0].endswith("fleet")}
    assert len(fleet) == 1, fleet
    if overlay == "dev":
        assert fleet == {"fleet:dev"}
    else:
        (image,) = fleet
        assert image.startswith("registry.example.com/fleet:0.1.0@sha256:"), image


def test_prod_refuses_an_image_by_tag_alone(tmp_path: Path) -> None:
    """The digest check fails on a prod overlay whose image lost its digest."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    kustomization = tree / "overlays" / "prod" / "kustomization.yaml"
    text = kustomization.read_text()
    assert text.count("    digest: sha256:") == 1
    kustomization.write_text(re.sub(r"\n    digest: sha256:[0-9a-f]+", "", text))
    errors = image_errors(build(tree / "overlays" / "prod"), by_digest=True)
    assert errors, "a tag-only prod image passed"
    assert all(e.endswith("registry.example.com/fleet:0.1.0: a tag, not a digest")
               for e in errors), errors
    assert len(errors) == 13  # 7 containers and 6 schema gates (Flower reads the store)
    moved = image_errors([{"kind": "Job", "metadata": {"name": "j"}, "spec": {"template": {
        "spec": {"containers": [{"name": "c", "image": "fleet@sha256:abc"},
                                {"name": "d", "image": "fleet:latest"}]}}}}], by_digest=False)
    assert moved == ["j/c: fleet@sha256:abc: not a sha256 digest", "j/d: fleet:latest: not pinned"]


def test_dev_runs_its_own_stores_and_the_policies_select_them() -> None:
    objs = render("dev")
    for name, store in (("fleet-redis", "redis"), ("fleet-postgres", "postgres")):
        sts = one(objs, "StatefulSet", name)
        assert sts["spec"]["replicas"] == 1
        assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
        assert one(objs, "Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
        labels = pod_template(sts)["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == store
        clients = store_clients(objs, labels, 6379 if store == "redis" else 5432)
        assert clients == (REDIS_CLIENTS if store == "redis" else POSTGRES_CLIENTS)
    assert configmap_data(objs)["FLEET_DIVERGENCE"] == "fail"


@pytest.mark.parametrize("overlay", ["prod", "prod-keda", "dev"])
def test_every_overlay_parks_a_diverged_run(overlay: str) -> None:
    """Issue 29.10: the base parks a re-run that skipped recorded steps (FLEET_DIVERGENCE
    fail, as ADR 0113's operators would after a clean run); warn is an overlay's choice."""
    assert configmap_data(render(overlay))["FLEET_DIVERGENCE"] == "fail"


@pytest.mark.parametrize("overlay", ["prod", "prod-keda"])
def test_prod_keeps_no_state_in_the_namespace(overlay: str) -> None:
    objs = render(overlay)
    assert not kinds(objs, "StatefulSet")
    assert not kinds(objs, "PersistentVolumeClaim")
    assert [s["metadata"]["name"] for s in kinds(objs, "Service")] == ["fleet-flower"]
    for obj in (o for o in objs if o["kind"] in WORKLOADS):
        volumes = pod_template(obj)["spec"].get("volumes", [])
        assert all(set(v) == {"name", "emptyDir"} for v in volumes), obj["metadata"]["name"]


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_the_hpa_scales_the_worker_deployment_on_cpu(overlay: str) -> None:
    objs = render(overlay)
    (hpa,) = kinds(objs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    worker = one(objs, "Deployment", target["name"])
    assert component(worker) == "worker"
    assert "replicas" not in worker["spec"], "the HPA owns the worker count"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    if overlay == "prod":
        dev = kinds(render("dev"), "HorizontalPodAutoscaler")[0]["spec"]
        assert hpa["spec"]["minReplicas"] > dev["minReplicas"]
        assert hpa["spec"]["maxReplicas"] > dev["maxReplicas"]


def test_keda_replaces_the_hpa_with_the_backlog_in_the_store() -> None:
    """Decision 0046; what each trigger asks and as whom: tests/deploy/test_keda_scalers.py."""
    objs = render("prod-keda")
    assert not kinds(objs, "HorizontalPodAutoscaler"), "two autoscalers on one Deployment"
    scaled = {o["metadata"]["name"]: o for o in kinds(objs, "ScaledObject")}
    for name, role in (("fleet-worker", "worker"), ("fleet-timers", "timers")):
        target = scaled[name]["spec"]["scaleTargetRef"]
        assert component(one(objs, target["kind"], target["name"])) == role
    backlog, cpu = scaled["fleet-worker"]["spec"]["triggers"]
    assert (backlog["type"], cpu["type"]) == ("postgresql", "cpu")
    assert set(backlog["metadata"]) == {"query", "targetQueryValue",
                                        "activationTargetQueryValue"}
    assert scaled["fleet-worker"]["spec"]["minReplicaCount"] == 4
    assert all(o["metadata"]["namespace"] == "fleet" for o in objs)


# -- the image -------------------------------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions (continuation lines joined), split into stages."""
    text = re.sub(r"\\\n", " ", (ROOT / "deploy" / "Dockerfile").read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((word.upper(), rest.strip()))
    return stages


def test_the_dockerfile_builds_wheels_apart_and_runs_as_the_manifests_expect() -> None:
    """A structural check (no image is built here: there is no Docker daemon)."""
    build_stage, runtime = dockerfile_stages()[-2:]
    assert build_stage[0][1].startswith("python:3.11-slim")
    assert runtime[0][1].startswith("python:3.11-slim")
    assert any(w == "RUN" and "pip wheel" in r and ".[postgres,fleet]" in r.replace('"', "")
               for w, r in build_stage)
    final = dict(runtime)
    assert final["USER"] == f"{UID}:{UID}"
    assert json.loads(final["ENTRYPOINT"]) == ["fleet"]
    runs = " ".join(r for w, r in runtime if w == "RUN")
    assert "apt-get install" not in runs, "no packages (let alone compilers) in the runtime"
    assert "pip uninstall" in runs
    assert "--mount=type=bind,from=build" in runs, "the wheels come from the build stage"
    assert "--no-index" in runs, "the runtime stage downloads nothing"
    env = " ".join(r for w, r in runtime if w == "ENV")
    assert "HOME=/home/fleet" in env
    for overlay in OVERLAYS:
        for obj in (o for o in render(overlay) if o["kind"] in WORKLOADS):
            spec = pod_template(obj)["spec"]
            if spec["containers"][0]["image"].split(":")[0].endswith("fleet"):
                mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
                assert {"/tmp", "/home/fleet"} <= mounts
                assert spec["securityContext"]["runAsUser"] == UID


def test_the_dockerfile_pins_its_base_image_by_digest() -> None:
    """Every stage starts FROM a tag pinned by digest (issue 28 item 4): a tag can be
    moved to other bytes after review, a digest cannot. Both stages on the same base."""
    froms = [stage[0][1].split()[0] for stage in dockerfile_stages()]
    assert froms, "no FROM line"
    for image in froms:
        name, _, digest = image.partition("@")
        assert name.startswith("python:3.11-slim"), image
        assert DIGEST.search("@" + digest), f"{image}: not pinned by @sha256:<64 hex>"
    assert len(set(froms)) == 1, froms
    # And a FROM without a digest is what the check catches.
    assert not DIGEST.search("python:3.11-slim-bookworm")


def test_each_overlay_names_its_fleet_for_signed_dispatches() -> None:
    """Decision 0045: a dispatch signed for dev never verifies in prod; neither overlay
    accepts unbound messages by default."""
    names = {overlay: configmap_data(render(overlay)) for overlay in OVERLAYS}
    assert {o: d.get("FLEET_ENVIRONMENT") for o, d in names.items()} == {
        "dev": "dev", "prod": "prod", "prod-keda": "prod"}
    assert not any("FLEET_DISPATCH_ALLOW_UNBOUND" in d for d in names.values())
