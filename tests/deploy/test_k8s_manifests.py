"""Kubernetes manifests (deploy/k8s): every overlay renders, validates against the pinned Kubernetes schemas
(LeaderWorkerSet against the schema kept in the repo), and is consistent: flags the CLI accepts, ports that line
up, resources, probes, security, disruption budgets, network policies. Each check also fails on a broken copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from deploy_checks import (
    GPU_OVERLAYS,
    K8S,
    KUBERNETES_VERSION,
    LWS_SCHEMA,
    OVERLAYS,
    Obj,
    check_flags,
    check_network_policies,
    check_pd_auth,
    check_pdbs,
    check_ports,
    check_probes,
    check_resources,
    check_security,
    find,
    mutated,
    render,
    role,
    run_tool,
    workloads,
)


def _kubernetes_validate(objs: list[Obj], tmp_path: Path, name: str) -> tuple[int, str]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(objs, sort_keys=False))
    out = run_tool("kubernetes-validate", "--strict", "-k", KUBERNETES_VERSION, "--quiet", str(path))
    return out.returncode, out.stdout + out.stderr


def _lws_problems(objs: list[Obj], tmp_path: Path) -> list[str]:
    """LeaderWorkerSets against the repo's schema, and their pod templates against core/v1 PodTemplate."""
    problems = []
    for i, lws in enumerate(o for o in objs if o["kind"] == "LeaderWorkerSet"):
        path = tmp_path / f"lws-{i}.json"
        path.write_text(json.dumps(lws))
        out = run_tool("check-jsonschema", "--schemafile", str(LWS_SCHEMA), str(path))
        if out.returncode != 0:
            problems.append(out.stdout + out.stderr)
        lwt = lws["spec"]["leaderWorkerTemplate"]
        templates = [
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{lws['metadata']['name']}-{k}"},
             "template": lwt[k]}
            for k in ("leaderTemplate", "workerTemplate") if k in lwt
        ]  # fmt: skip
        code, text = _kubernetes_validate(templates, tmp_path, f"lws-{i}-templates")
        if code != 0:
            problems.append(text)
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(rendered: dict[str, list[Obj]], overlay: str, tmp_path: Path) -> None:
    objs = rendered[overlay]
    kinds = {o["kind"] for o in objs}
    assert {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    code, text = _kubernetes_validate(objs, tmp_path, overlay)
    assert code == 0, text
    assert _lws_problems(objs, tmp_path) == []


def test_kubernetes_validate_catches_bad_fields(rendered: dict[str, list[Obj]], tmp_path: Path) -> None:
    objs = mutated(rendered["gpu-tcp"])
    find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]["containers"][0]["startupProbe"][
        "periodSecond"] = 10  # fmt: skip
    code, text = _kubernetes_validate(objs, tmp_path, "bad-field")
    assert code != 0 and "periodSecond" in text
    objs = mutated(rendered["gpu-tcp"])
    find(objs, "Deployment", "hisparse-router")["spec"]["replicas"] = "two"
    code, text = _kubernetes_validate(objs, tmp_path, "bad-type")
    assert code != 0 and "two" in text


def test_lws_schema_catches_bad_objects(rendered: dict[str, list[Obj]], tmp_path: Path) -> None:
    objs = mutated(rendered["gpu-rdma-lws"])
    lws = find(objs, "LeaderWorkerSet", "hisparse-decode")
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"  # not one of the CRD's enum values
    assert _lws_problems(objs, tmp_path)
    objs = mutated(rendered["gpu-rdma-lws"])
    find(objs, "LeaderWorkerSet", "hisparse-decode")["spec"]["leaderWorkerTemplate"]["groupSize"] = 2
    assert _lws_problems(objs, tmp_path)
    objs = mutated(rendered["gpu-rdma-lws"])
    spec = find(objs, "LeaderWorkerSet", "hisparse-decode")["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    spec["containers"][0]["resource"] = spec["containers"][0].pop("resources")  # typo inside the pod template
    assert _lws_problems(objs, tmp_path)


def test_kustomize_catches_a_broken_overlay(tmp_path: Path) -> None:
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    kustomization = copy / "overlays" / "gpu-rdma" / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text().replace("- path: rdma.yaml", "- path: rdma-missing.yaml"))
    with pytest.raises(RuntimeError, match="rdma-missing"):
        render(copy / "overlays" / "gpu-rdma")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_flags_are_flags_the_cli_accepts(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert check_flags(rendered[overlay]) == []


def test_flag_check_catches_unknown_flags_and_values(rendered: dict[str, list[Obj]]) -> None:
    objs = mutated(rendered["cpu-demo"])
    container = find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]["containers"][0]
    container["args"].append("--enable-hisparse-turbo")
    assert any("--enable-hisparse-turbo" in p for p in check_flags(objs))
    objs = mutated(rendered["cpu-demo"])
    find(objs, "ConfigMap", next(o["metadata"]["name"] for o in objs if o["kind"] == "ConfigMap"))["data"][
        "HISPARSE_CONFIG"] = '{"top_k": 0}'  # fmt: skip
    assert any("top_k" in p for p in check_flags(objs))
    objs = mutated(rendered["cpu-demo"])
    container = find(objs, "StatefulSet", "hisparse-prefill")["spec"]["template"]["spec"]["containers"][0]
    container["args"].append("--context-length=$(CONTEXT_LENGHT)")
    assert any("CONTEXT_LENGHT" in p for p in check_flags(objs))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_line_up(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert check_flags(rendered[overlay]) == []  # the ports are read from the parsed flags
    assert check_ports(rendered[overlay]) == []


def test_port_check_catches_mismatches(rendered: dict[str, list[Obj]]) -> None:
    objs = mutated(rendered["gpu-tcp"])
    container = find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGet"]["port"] = "metrics"
    assert any("readinessProbe port 'metrics' names no container port" in p for p in check_ports(objs))
    objs = mutated(rendered["gpu-tcp"])
    container = find(objs, "StatefulSet", "hisparse-prefill")["spec"]["template"]["spec"]["containers"][0]
    container["args"] = [a.replace("--disaggregation-bootstrap-port=8998", "--disaggregation-bootstrap-port=8999")
                         for a in container["args"]]  # fmt: skip
    assert any("bootstrap port" in p for p in check_ports(objs))
    objs = mutated(rendered["gpu-tcp"])
    find(objs, "Service", "hisparse-prefill")["spec"]["ports"][1]["port"] = 8999
    assert any("port 8999 != container port 8998" in p for p in check_ports(objs))
    objs = mutated(rendered["gpu-tcp"])
    router = find(objs, "Deployment", "hisparse-router")["spec"]["template"]["spec"]["containers"][0]
    router["args"] = [a.replace("hisparse-decode-0.", "hisparse-decode-1.") for a in router["args"]]
    assert any("has 1 replica(s)" in p for p in check_ports(objs))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_probes_and_budgets(rendered: dict[str, list[Obj]], overlay: str) -> None:
    gpu = overlay in GPU_OVERLAYS
    assert check_resources(rendered[overlay], gpu=gpu) == []
    assert check_probes(rendered[overlay], min_startup_s=1800 if gpu else 600) == []
    assert check_pdbs(rendered[overlay]) == []


def test_resource_probe_and_budget_checks_catch_mistakes(rendered: dict[str, list[Obj]]) -> None:
    objs = mutated(rendered["gpu-rdma"])
    container = find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]["containers"][0]
    del container["resources"]["limits"]["nvidia.com/gpu"]
    assert any("no nvidia.com/gpu limit" in p for p in check_resources(objs, gpu=True))
    objs = mutated(rendered["gpu-tcp"])
    container = find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["limits"]["memory"] = "128Gi"  # less than the 192GiB host pool
    assert any("does not hold the host KV pool" in p for p in check_resources(objs, gpu=True))
    objs = mutated(rendered["gpu-rdma-tp8"])
    container = find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["limits"]["nvidia.com/gpu"] = container["resources"]["requests"]["nvidia.com/gpu"] = 4
    assert any("--tp-size 8 needs 8 GPUs, the pod has 4" in p for p in check_resources(objs, gpu=True))
    objs = mutated(rendered["gpu-rdma-tp8"])
    pod = find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]
    next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] = "192Gi"  # the pool alone
    assert any("does not hold the shared host KV pool" in p for p in check_resources(objs, gpu=True))
    objs = mutated(rendered["gpu-rdma-tp8"])
    container = find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["limits"]["memory"] = "200Gi"  # the pool, not its /dev/shm with the staging
    assert any("with its PD staging" in p for p in check_resources(objs, gpu=True))
    objs = mutated(rendered["cpu-demo"])
    pod = find(objs, "StatefulSet", "hisparse-prefill")["spec"]["template"]["spec"]
    next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"].pop("medium")
    assert any("/dev/shm" in p for p in check_resources(objs, gpu=False))
    objs = mutated(rendered["gpu-tcp"])
    container = find(objs, "StatefulSet", "hisparse-prefill")["spec"]["template"]["spec"]["containers"][0]
    container["startupProbe"]["failureThreshold"] = 30
    assert any("startup probe allows 300 s" in p for p in check_probes(objs, min_startup_s=1800))
    objs = mutated(rendered["gpu-tcp"])
    find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30
    assert any("grace period" in p for p in check_probes(objs, min_startup_s=1800))
    objs = mutated(rendered["gpu-tcp"])
    container = find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]["containers"][0]
    container["args"] = [a for a in container["args"] if not a.startswith("--graceful-shutdown-timeout")]
    assert any("no --graceful-shutdown-timeout" in p for p in check_probes(objs, min_startup_s=1800))
    objs = [o for o in mutated(rendered["gpu-tcp"]) if o["metadata"]["name"] != "hisparse-decode"
            or o["kind"] != "PodDisruptionBudget"]  # fmt: skip
    assert check_pdbs(objs) == ["StatefulSet/hisparse-decode: covered by 0 PodDisruptionBudgets"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security(rendered: dict[str, list[Obj]], overlay: str) -> None:
    caps = frozenset({"IPC_LOCK"}) if "rdma" in overlay else frozenset()
    assert check_security(rendered[overlay], caps) == []


def test_security_check_catches_mistakes(rendered: dict[str, list[Obj]]) -> None:
    objs = mutated(rendered["gpu-rdma"])
    assert check_security(objs, frozenset()) != []  # IPC_LOCK is for the RDMA overlays only
    objs = mutated(rendered["cpu-demo"])
    router = find(objs, "Deployment", "hisparse-router")["spec"]["template"]["spec"]["containers"][0]
    router["args"] = [a if not a.startswith("--api-key") else "--api-key=sk-plaintext" for a in router["args"]]
    assert any("API key given literally" in p for p in check_security(objs, frozenset()))
    objs = mutated(rendered["cpu-demo"])
    objs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hisparse-api-key"},
                 "stringData": {"api-key": "sk-plaintext"}})  # fmt: skip
    assert any("Secret/hisparse-api-key" in p for p in check_security(objs, frozenset()))
    objs = mutated(rendered["cpu-demo"])
    container = find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"]["readOnlyRootFilesystem"] = False
    assert any("root filesystem writable" in p for p in check_security(objs, frozenset()))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pd_control_plane_is_authenticated(rendered: dict[str, list[Obj]], overlay: str) -> None:
    objs = rendered[overlay]
    assert check_pd_auth(objs) == []
    roles = {role(t) for _, t, _ in workloads(objs)}
    assert {"prefill", "decode", "router"} <= roles


def test_pd_auth_check_catches_mistakes(rendered: dict[str, list[Obj]]) -> None:
    objs = mutated(rendered["cpu-demo"])
    decode = find(objs, "StatefulSet", "hisparse-decode")["spec"]["template"]["spec"]
    decode["containers"][0]["args"] = [a for a in decode["containers"][0]["args"]
                                       if not a.startswith("--disaggregation-auth-secret-file")]  # fmt: skip
    assert any("no --disaggregation-auth-secret-file" in p for p in check_pd_auth(objs))
    objs = mutated(rendered["cpu-demo"])
    router = find(objs, "Deployment", "hisparse-router")["spec"]["template"]["spec"]
    next(v for v in router["volumes"] if v["name"] == "pd-auth")["secret"]["optional"] = True
    assert any("not mounted from the Secret" in p for p in check_pd_auth(objs))
    objs = mutated(rendered["cpu-demo"])
    prefill = find(objs, "StatefulSet", "hisparse-prefill")["spec"]["template"]["spec"]
    next(v for v in prefill["volumes"] if v["name"] == "pd-auth")["secret"]["defaultMode"] = 0o444
    assert any("readable by others" in p for p in check_pd_auth(objs))
    objs = mutated(rendered["cpu-demo"])
    router = find(objs, "Deployment", "hisparse-router")["spec"]["template"]["spec"]["containers"][0]
    router["args"] = [a for a in router["args"] if not a.startswith("--worker-api-key")]
    assert any("--worker-api-key does not come from" in p for p in check_pd_auth(objs))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(rendered: dict[str, list[Obj]], overlay: str) -> None:
    assert check_flags(rendered[overlay]) == []  # the roles' ports are read from the parsed flags
    assert check_network_policies(rendered[overlay]) == []


def test_network_policy_check_catches_open_ports(rendered: dict[str, list[Obj]]) -> None:
    objs = mutated(rendered["gpu-tcp"])
    policy = find(objs, "NetworkPolicy", "hisparse-prefill")
    policy["spec"]["ingress"][1]["ports"][0]["endPort"] = 30000  # transfer range now covers the HTTP port
    assert "decode -> prefill http: allowed, expected blocked" in check_network_policies(objs)
    objs = mutated(rendered["gpu-tcp"])
    del find(objs, "NetworkPolicy", "hisparse-decode")["spec"]["ingress"][0]["from"]
    assert "other namespace -> decode http: allowed, expected blocked" in check_network_policies(objs)
    objs = [o for o in mutated(rendered["gpu-tcp"]) if o["metadata"]["name"] != "hisparse-prefill"
            or o["kind"] != "NetworkPolicy"]  # fmt: skip
    assert "decode -> prefill bootstrap: allowed, expected blocked" not in check_network_policies(objs)
    assert "decode -> prefill bootstrap: blocked, expected allowed" in check_network_policies(objs)


def test_docs_scaling_example(tmp_path: Path) -> None:
    """docs/deploy.md's overlay that adds a decode pod renders, and its router lists both decode pods."""
    text = (K8S.parents[1] / "docs" / "deploy.md").read_text()
    block = next(b for b in text.split("```yaml\n")[1:] if "hisparse-decode-1.hisparse-decode" in b)
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    (copy / "overlays" / "scaled").mkdir()
    (copy / "overlays" / "scaled" / "kustomization.yaml").write_text(block.split("```")[0])
    objs = render(copy / "overlays" / "scaled")
    assert find(objs, "StatefulSet", "hisparse-decode")["spec"]["replicas"] == 2
    assert check_flags(objs) == [] and check_ports(objs) == []
    router = find(objs, "Deployment", "hisparse-router")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router.count("--decode") == 2
    find(objs, "StatefulSet", "hisparse-prefill")["spec"]["replicas"] = 2  # scaled without telling the router
    assert check_ports(objs) == ["hisparse-router: http://hisparse-prefill-1.hisparse-prefill:30000 is not in "
                                 "the router's list (a pod that gets no requests)"]  # fmt: skip
