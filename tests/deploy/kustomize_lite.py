"""A small kustomize renderer for the fleet's manifests (``deploy/k8s``), for tests.

Why not kustomize itself: it is a Go program, not a Python dependency the test
suite can install from PyPI. The one PyPI package that wraps the real kustomize
library (``pykustomize``) needs Python >= 3.14; fleet supports 3.11. So this
module renders exactly the kustomize features ``deploy/k8s`` uses, the way
kustomize 5 does, and ``test_manifests.py`` checks it object for object
against ``kubectl kustomize`` (kustomize 5.x built into kubectl).

Supported, and nothing else (anything else raises ``UnsupportedFeatureError``, so a
manifest that needs more fails here instead of rendering wrong):

- ``resources``: YAML files (several documents each) and directories holding a
  ``kustomization.yaml`` (built on their own, then added);
- ``components``: directories holding a ``kind: Component`` kustomization,
  applied to everything accumulated so far;
- ``namespace``: set on every namespaced object;
- ``labels``: ``pairs`` added to ``metadata.labels`` and, with
  ``includeTemplates``, to pod templates; ``includeSelectors`` must be false;
- ``images``: ``name`` with ``newName`` / ``newTag`` / ``digest``, for the
  containers and init containers of pod templates;
- ``patches``: strategic merge patches by ``path`` or inline ``patch``,
  matched to one object by group, kind and name; ``$patch: delete`` removes it;
  lists merge by key for containers, initContainers, env, volumes and
  volumeMounts and are replaced otherwise (what Kubernetes does for atomic
  lists); other keyed lists (``ports``, ...) are refused;
- ``configMapGenerator``: ``literals`` with ``behavior`` create, merge or
  replace; the name gets kustomize's content hash suffix and every reference
  from a pod template (``envFrom``, ``configMapKeyRef``, volumes) follows it.

The steps run in kustomize's order: resources, components, generators, then
the transformers namespace, patches, labels, images; hash suffixes and name
references last, once, at the top.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

__all__ = ["KustomizeError", "UnsupportedFeatureError", "build", "configmap_hash"]


class KustomizeError(Exception):
    """The kustomization is wrong (a missing file, a patch with no target, ...)."""


class UnsupportedFeatureError(KustomizeError):
    """The kustomization uses something this renderer does not implement."""


_KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
_FIELDS = {"apiVersion", "kind", "resources", "components", "namespace", "labels", "images",
           "patches", "configMapGenerator"}
_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                   "PersistentVolume", "StorageClass", "PriorityClass", "IngressClass",
                   "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"}
# Kinds whose namespace transformer does more than set metadata.namespace.
_REFUSED_KINDS = {"RoleBinding", "ClusterRoleBinding"}
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name",
               "env": "name", "volumes": "name", "volumeMounts": "mountPath"}
# Keyed lists in Kubernetes' schema that this renderer does not merge.
_REFUSED_LISTS = {"ports", "imagePullSecrets", "topologySpreadConstraints", "hostAliases",
                  "envFrom", "resourceClaims", "finalizers"}
_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


@dataclass
class _Resource:
    obj: Obj
    generated_name: str | None = None  # set for a configMapGenerator output: hash it at the end


def build(directory: str | Path) -> list[Obj]:
    """Render the kustomization in ``directory``: the objects ``kustomize build`` would print."""
    resources = _accumulate(Path(directory), "Kustomization", [])
    _add_hashes_and_fix_references(resources)
    return [r.obj for r in resources]


def configmap_hash(data: dict[str, str]) -> str:
    """kustomize's name suffix for a generated ConfigMap holding ``data``.

    kustomize 5 hashes ``{"data": ..., "kind": "ConfigMap", "name": ""}`` as Go's
    ``json.Marshal`` writes it (sorted keys, no spaces, ``<>&`` escaped): the
    name is empty when generated objects are hashed (seen on kustomize 5.0.1 to
    5.6.0; the renderer test compares names with ``kubectl kustomize``). The
    first ten hex digits of its SHA-256 are kept, with 0 1 3 a e turned into
    g h k m t so the suffix never looks like a number or a word.
    """
    text = json.dumps({"data": data, "kind": "ConfigMap", "name": ""}, sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    for char, escape in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


# -- accumulation ---------------------------------------------------------------------


def _load_kustomization(directory: Path, kind: str) -> Obj:
    for name in _KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            data = yaml.safe_load(path.read_text()) or {}
            break
    else:
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    unknown = set(data) - _FIELDS
    if unknown:
        raise UnsupportedFeatureError(f"{directory}: kustomization fields {sorted(unknown)}")
    found = data.get("kind", "Kustomization")
    if found != kind:
        raise KustomizeError(f"{directory}: expected a {kind}, found a {found}")
    return data


def _accumulate(directory: Path, kind: str, accumulated: list[_Resource]) -> list[_Resource]:
    k = _load_kustomization(directory, kind)
    out = list(accumulated)
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            added = _accumulate(path, "Kustomization", [])
        elif path.is_file():
            added = [_Resource(obj) for obj in _load_objects(path)]
        else:
            raise KustomizeError(f"{directory}: resource {entry!r} does not exist")
        for resource in added:
            _add(out, resource, directory)
    for entry in k.get("components", []):
        path = directory / entry
        if not path.is_dir():
            raise KustomizeError(f"{directory}: component {entry!r} is not a directory")
        out = _accumulate(path, "Component", out)
    for generator in k.get("configMapGenerator", []):
        _generate_configmap(out, generator, directory)
    if "namespace" in k:
        _set_namespace(out, k["namespace"])
    for patch in k.get("patches", []):
        out = _apply_patch_entry(out, patch, directory)
    for entry in k.get("labels", []):
        _add_labels(out, entry, directory)
    for entry in k.get("images", []):
        _set_image(out, entry, directory)
    return out


def _load_objects(path: Path) -> list[Obj]:
    objects = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for obj in objects:
        if not isinstance(obj, dict) or not obj.get("kind") or not obj.get("apiVersion"):
            raise KustomizeError(f"{path}: a document without apiVersion and kind")
        if obj["kind"] in ("Kustomization", "Component"):
            raise KustomizeError(f"{path}: a kustomization listed as a resource file")
        if not obj.get("metadata", {}).get("name"):
            raise KustomizeError(f"{path}: a {obj['kind']} without metadata.name")
        if obj["kind"] in _REFUSED_KINDS:
            raise UnsupportedFeatureError(f"{path}: {obj['kind']} (its subjects' namespaces)")
    return objects


def _group(api_version: str) -> str:
    return api_version.split("/")[0] if "/" in api_version else ""


def _identity(obj: Obj) -> tuple[str, str, str, str]:
    meta = obj.get("metadata", {})
    return (_group(obj["apiVersion"]), obj["kind"], meta.get("namespace", ""), meta["name"])


def _add(resources: list[_Resource], resource: _Resource, where: Path) -> None:
    if any(_identity(r.obj) == _identity(resource.obj) for r in resources):
        raise KustomizeError(f"{where}: {_identity(resource.obj)} is defined twice")
    resources.append(resource)


# -- generators -----------------------------------------------------------------------


def _literal(source: str, where: Path) -> tuple[str, str]:
    key, sep, value = source.partition("=")
    if not sep or not key:
        raise KustomizeError(f"{where}: literal {source!r} is not KEY=VALUE")
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]  # kustomize strips one pair of matching quotes
    return key, value


def _generate_configmap(resources: list[_Resource], generator: Obj, where: Path) -> None:
    unknown = set(generator) - {"name", "behavior", "literals"}
    if unknown:
        raise UnsupportedFeatureError(f"{where}: configMapGenerator fields {sorted(unknown)}")
    name = generator["name"]
    data = dict(_literal(item, where) for item in generator.get("literals", []))
    behavior = generator.get("behavior", "create")
    existing = [r for r in resources if r.generated_name == name]
    if behavior == "create":
        if existing:
            raise KustomizeError(f"{where}: ConfigMap {name} is generated twice (use merge)")
        obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name},
               "data": data}
        _add(resources, _Resource(obj, generated_name=name), where)
        return
    if behavior not in ("merge", "replace"):
        raise KustomizeError(f"{where}: configMapGenerator behavior {behavior!r}")
    if len(existing) != 1:
        raise KustomizeError(f"{where}: no generated ConfigMap {name} to {behavior}")
    target = existing[0].obj
    target["data"] = {**target.get("data", {}), **data} if behavior == "merge" else data


# -- transformers ---------------------------------------------------------------------


def _set_namespace(resources: list[_Resource], namespace: str) -> None:
    for resource in resources:
        if resource.obj["kind"] not in _CLUSTER_SCOPED:
            resource.obj.setdefault("metadata", {})["namespace"] = namespace


def _apply_patch_entry(resources: list[_Resource], entry: Obj,
                       where: Path) -> list[_Resource]:
    unknown = set(entry) - {"path", "patch"}
    if unknown:
        raise UnsupportedFeatureError(f"{where}: patch fields {sorted(unknown)} (targets, options)")
    if ("path" in entry) == ("patch" in entry):
        raise KustomizeError(f"{where}: a patch needs exactly one of path and patch")
    text = (where / entry["path"]).read_text() if "path" in entry else entry["patch"]
    for patch in (doc for doc in yaml.safe_load_all(text) if doc is not None):
        if not isinstance(patch, dict):
            raise UnsupportedFeatureError(f"{where}: a JSON 6902 patch")
        resources = _apply_patch(resources, patch, where)
    return resources


def _apply_patch(resources: list[_Resource], patch: Obj, where: Path) -> list[_Resource]:
    meta = patch.get("metadata", {})
    matches = [r for r in resources
               if r.obj["kind"] == patch.get("kind")
               and _group(r.obj["apiVersion"]) == _group(patch.get("apiVersion", ""))
               and r.obj["metadata"]["name"] == meta.get("name")
               and ("namespace" not in meta
                    or r.obj["metadata"].get("namespace") == meta["namespace"])]
    if len(matches) != 1:
        raise KustomizeError(f"{where}: patch for {patch.get('kind')}/{meta.get('name')} "
                             f"matches {len(matches)} objects")
    target = matches[0]
    if patch.get("$patch") == "delete":
        return [r for r in resources if r is not target]
    body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
    target.obj = _merge(target.obj, body)
    return resources


def _merge(base: Obj, patch: Obj) -> Obj:
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive is not None:
        raise UnsupportedFeatureError(f"$patch: {directive} inside an object")
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if key.startswith("$"):
            raise UnsupportedFeatureError(f"patch directive {key}")
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and key in _MERGE_KEYS and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, _MERGE_KEYS[key])
        elif isinstance(value, list) and key in _REFUSED_LISTS:
            raise UnsupportedFeatureError(f"a patch of the keyed list {key!r}")
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_list(base: list[Any], patch: list[Any], key: str) -> list[Any]:
    out = copy.deepcopy(base)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise KustomizeError(f"a list item patched by {key!r} has no {key!r}: {item!r}")
        index = next((i for i, old in enumerate(out) if old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del out[index]
        elif index is None:
            out.append(copy.deepcopy(item))
        else:
            out[index] = _merge(out[index], item)
    return out


def _pod_specs(obj: Obj) -> list[Obj]:
    spec = obj.get("spec", {})
    if obj["kind"] == "Pod":
        return [spec]
    if obj["kind"] in _TEMPLATE_KINDS:
        return [spec.get("template", {}).get("spec", {})]
    if obj["kind"] == "CronJob":
        return [spec.get("jobTemplate", {}).get("spec", {}).get("template", {}).get("spec", {})]
    return []


def _template_metadata(obj: Obj) -> list[Obj]:
    if obj["kind"] in _TEMPLATE_KINDS:
        spec = obj.setdefault("spec", {})
        return [spec.setdefault("template", {}).setdefault("metadata", {})]
    if obj["kind"] == "CronJob":
        job = obj.setdefault("spec", {}).setdefault("jobTemplate", {})
        return [job.setdefault("metadata", {}),
                job.setdefault("spec", {}).setdefault("template", {}).setdefault("metadata", {})]
    return []


def _add_labels(resources: list[_Resource], entry: Obj, where: Path) -> None:
    unknown = set(entry) - {"pairs", "includeSelectors", "includeTemplates"}
    if unknown:
        raise UnsupportedFeatureError(f"{where}: labels fields {sorted(unknown)}")
    if entry.get("includeSelectors"):
        raise UnsupportedFeatureError(f"{where}: labels with includeSelectors (selectors are "
                                 "immutable: keep them out of a transformer)")
    pairs = {str(k): str(v) for k, v in entry.get("pairs", {}).items()}
    for resource in resources:
        resource.obj.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
        if entry.get("includeTemplates"):
            for meta in _template_metadata(resource.obj):
                meta.setdefault("labels", {}).update(pairs)


def _split_image(image: str) -> tuple[str, str, str]:
    """``name``, ``:tag`` or "", ``@digest`` or ""."""
    name, at, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon:]
    return name, tag, at + digest


def _set_image(resources: list[_Resource], entry: Obj, where: Path) -> None:
    unknown = set(entry) - {"name", "newName", "newTag", "digest"}
    if unknown:
        raise UnsupportedFeatureError(f"{where}: images fields {sorted(unknown)}")
    for resource in resources:
        for pod in _pod_specs(resource.obj):
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                name, tag, digest = _split_image(container.get("image", ""))
                if name != entry["name"]:
                    continue
                name = entry.get("newName", name)
                if "newTag" in entry:
                    tag, digest = f":{entry['newTag']}", ""
                if "digest" in entry:
                    tag, digest = "", f"@{entry['digest']}"
                container["image"] = name + tag + digest


# -- the last steps -------------------------------------------------------------------


def _add_hashes_and_fix_references(resources: list[_Resource]) -> None:
    renamed: dict[tuple[str, str], str] = {}
    for resource in resources:
        if resource.generated_name is None:
            continue
        meta = resource.obj["metadata"]
        new = f"{resource.generated_name}-{configmap_hash(resource.obj.get('data', {}))}"
        renamed[(meta.get("namespace", ""), resource.generated_name)] = new
        meta["name"] = new
    for resource in resources:
        namespace = resource.obj.get("metadata", {}).get("namespace", "")
        for pod in _pod_specs(resource.obj):
            _rename_configmap_refs(pod, lambda n, ns=namespace: renamed.get((ns, n), n))


def _rename_configmap_refs(pod: Obj, rename: Any) -> None:
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                source["configMapRef"]["name"] = rename(source["configMapRef"]["name"])
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("configMapKeyRef")
            if ref is not None:
                ref["name"] = rename(ref["name"])
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            volume["configMap"]["name"] = rename(volume["configMap"]["name"])
        for source in volume.get("projected", {}).get("sources", []):
            if "configMap" in source:
                source["configMap"]["name"] = rename(source["configMap"]["name"])
