"""Checks of the deployment files (Dockerfile, compose, kustomize renders), shared by the tests in this folder.

Each check returns a list of problems (empty = fine), so a test can assert that the real files pass and that a
broken copy fails with the expected problem. Tools run from the test environment's bin directory (the pinned
wheels of the `test` extra): hadolint, kubectl (kustomize), kubernetes-validate, yamllint, check-jsonschema.
"""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from decode_server import cli

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu-demo", "gpu-tcp", "gpu-rdma", "gpu-rdma-lws", "gpu-rdma-tp8")
GPU_OVERLAYS = ("gpu-tcp", "gpu-rdma", "gpu-rdma-lws", "gpu-rdma-tp8")
# A tensor-parallel HiSparse server keeps its host KV pool in /dev/shm (shared by its ranks), and a PD decode
# server its index-key staging beside it: 132 B per host row and layer, +20 % of a 656 B FP8 row (+11.5 % of bf16).
PD_STAGING_SHM_FACTOR = 1.25
KUBERNETES_VERSION = "1.37.0"
LWS_SCHEMA = K8S / "schemas" / "leaderworkerset-v1.json"
BIN = Path(sys.executable).parent
SERVER_ROLES = ("prefill", "decode")
COMPONENT = "app.kubernetes.io/component"

Obj = dict[str, Any]


def tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: install the project's test extra (make install)")
    return str(path)


def run_tool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool(args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True, timeout=120)


def docker_context_paths() -> list[str]:
    """What .dockerignore admits into the image's build context (its `!path` lines, in order)."""
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line[1:].rstrip("/") for line in lines if line.startswith("!")]


# ---------------------------------------------------------------- rendering


def render(kustomization_dir: Path) -> list[Obj]:
    out = run_tool("kubectl", "kustomize", str(kustomization_dir))
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {kustomization_dir} failed:\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    for obj in objs:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise KeyError(f"{kind}/{name}")


def pod_templates(obj: Obj) -> list[Obj]:
    """The pod templates of a workload (Deployment, StatefulSet, LeaderWorkerSet); [] for other kinds."""
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return [obj["spec"]["template"]]
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [lwt[k] for k in ("leaderTemplate", "workerTemplate") if k in lwt]
    return []


def workloads(objs: list[Obj]) -> Iterator[tuple[Obj, Obj, Obj]]:
    """(workload, pod template, container) for every container of every workload."""
    for obj in objs:
        for template in pod_templates(obj):
            for container in template["spec"]["containers"]:
                yield obj, template, container


def role(template: Obj) -> str:
    return template["metadata"]["labels"][COMPONENT]


def name_of(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


# ---------------------------------------------------------------- arguments

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_env(container: Obj, objs: list[Obj]) -> dict[str, str]:
    """Environment as Kubernetes builds it: envFrom ConfigMaps first, then env (secrets as placeholders)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(find(objs, "ConfigMap", source["configMapRef"]["name"]).get("data", {}))
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "secretKeyRef" in (item.get("valueFrom") or {}):
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = f"<secret {ref['name']}/{ref['key']}>"
        elif "configMapKeyRef" in (item.get("valueFrom") or {}):
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = find(objs, "ConfigMap", ref["name"])["data"][ref["key"]]
    return env


def expand_args(container: Obj, objs: list[Obj]) -> tuple[list[str], list[str]]:
    """The container's args with $(VAR) expanded; second value: the names of undefined variables."""
    env = container_env(container, objs)
    missing: list[str] = []

    def sub(match: re.Match[str]) -> str:
        if match.group(1) not in env:
            missing.append(match.group(1))
            return match.group(0)
        return env[match.group(1)]

    return [_VAR.sub(sub, str(a)) for a in container.get("args", [])], missing


def parse_cli(args: list[str]) -> tuple[Any, str | None]:
    """Parse with decode-server's own parser and config validation; (namespace, None) or (None, error)."""
    parser = cli.build_parser()
    try:
        ns = parser.parse_args(args)
    except SystemExit:
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
            parser.parse_args(args)
        return None, err.getvalue().strip().splitlines()[-1] if err.getvalue() else "rejected"
    try:
        if ns.command == "serve":
            cli.engine_config_from_args(ns)
            cli.server_config_from_args(ns)
        elif ns.command == "router" and hasattr(cli, "router_config_from_args"):
            cli.router_config_from_args(ns)
    except Exception as exc:  # noqa: BLE001 (pydantic and value errors alike are a rejected configuration)
        return None, f"{type(exc).__name__}: {exc}"
    return ns, None


def check_flags(objs: list[Obj]) -> list[str]:
    problems = []
    for obj, _, container in workloads(objs):
        args, missing = expand_args(container, objs)
        where = f"{name_of(obj)} container {container['name']}"
        if missing:
            problems.append(f"{where}: undefined variables {missing}")
            continue
        _, error = parse_cli(args)
        if error:
            problems.append(f"{where}: {shlex.join(args)}: {error}")
    return problems


# ---------------------------------------------------------------- ports


def _port_number(container: Obj, port: int | str) -> int | None:
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


def _probe_ports(container: Obj) -> Iterator[tuple[str, int | str]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        if probe:
            action = probe.get("httpGet") or probe.get("tcpSocket") or probe.get("grpc") or {}
            yield kind, action.get("port")


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def server_ports(objs: list[Obj]) -> dict[str, dict[str, Any]]:
    """Per workload name: its role, --port, bootstrap port (prefill), headless service name, replicas."""
    out = {}
    for obj, template, container in workloads(objs):
        args, _ = expand_args(container, objs)
        ns, _ = parse_cli(args)
        if ns is None:
            continue
        service = obj["spec"].get("serviceName") if obj["kind"] == "StatefulSet" else obj["metadata"]["name"]
        out[obj["metadata"]["name"]] = {
            "kind": obj["kind"], "role": role(template), "port": ns.port, "service": service,
            "bootstrap": getattr(ns, "disaggregation_bootstrap_port", None), "replicas": obj["spec"]["replicas"],
            "ns": ns, "container": container, "labels": template["metadata"]["labels"],
        }  # fmt: skip
    return out


def check_ports(objs: list[Obj]) -> list[str]:
    problems = []
    servers = server_ports(objs)
    for obj, _, container in workloads(objs):
        where = f"{name_of(obj)} container {container['name']}"
        for kind, port in _probe_ports(container):
            if _port_number(container, port) is None:
                problems.append(f"{where}: {kind} port {port!r} names no container port")
        info = servers.get(obj["metadata"]["name"])
        if info is None:
            continue
        if _port_number(container, "http") != info["port"]:
            problems.append(f"{where}: --port {info['port']} is not the 'http' container port")
        if info["role"] == "prefill" and _port_number(container, "bootstrap") != info["bootstrap"]:
            problems.append(f"{where}: bootstrap port {info['bootstrap']} is not the 'bootstrap' container port")
        health = container_env(container, objs).get("DECODE_SERVER_HEALTH_URL", "")
        if not health.endswith(f":{info['port']}/health"):
            problems.append(f"{where}: DECODE_SERVER_HEALTH_URL {health!r} is not this server's /health")
    # Services: each selects pods whose containers have the target ports.
    for svc in (o for o in objs if o["kind"] == "Service"):
        pods = [(t, c) for _, t, c in workloads(objs) if _selects(svc["spec"]["selector"], t["metadata"]["labels"])]
        if not pods:
            problems.append(f"{name_of(svc)}: selects no pod")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for _, container in pods:
                number = _port_number(container, target)
                if number is None:
                    problems.append(f"{name_of(svc)}: targetPort {target!r} names no port of {container['name']}")
                elif port["port"] != number:
                    problems.append(f"{name_of(svc)}: port {port['port']} != container port {number}")
    # The router's worker URLs: pod <workload>-<i>.<headless service>:<its --port> (+ prefill bootstrap port).
    for name, info in servers.items():
        if info["role"] != "router":
            continue
        ns = info["ns"]
        targets = [(v[0], v[1] if len(v) > 1 else None, "prefill") for v in ns.prefill]
        targets += [(u, None, "decode") for u in ns.decode]
        for url, bootstrap, want_role in targets:
            problems += _check_worker_url(name, url, bootstrap, want_role, servers, objs)
        listed = {url for url, _, _ in targets}
        for worker, winfo in servers.items():
            if winfo["role"] not in SERVER_ROLES:
                continue
            for i in range(winfo["replicas"]):
                url = f"http://{worker}-{i}.{winfo['service']}:{winfo['port']}"
                if url not in listed:
                    problems.append(f"{name}: {url} is not in the router's list (a pod that gets no requests)")
    return problems


def _check_worker_url(router: str, url: str, bootstrap: str | None, want_role: str,
                      servers: dict[str, dict[str, Any]], objs: list[Obj]) -> list[str]:  # fmt: skip
    match = re.fullmatch(r"http://(?P<pod>[a-z0-9-]+)-(?P<i>\d+)\.(?P<svc>[a-z0-9-]+):(?P<port>\d+)", url)
    if not match:
        return [f"{router}: worker URL {url} is not http://<pod>-<i>.<service>:<port>"]
    target = servers.get(match["pod"])
    if target is None or target["role"] != want_role:
        return [f"{router}: {url} names no {want_role} workload {match['pod']!r}"]
    problems = []
    if target["service"] != match["svc"]:
        problems.append(f"{router}: {url}: {match['pod']} pods live in service {target['service']!r}")
    elif target["kind"] != "LeaderWorkerSet":  # LWS creates its own headless service
        svc = find(objs, "Service", match["svc"])
        if svc["spec"].get("clusterIP") != "None" or not _selects(svc["spec"]["selector"], target["labels"]):
            problems.append(f"{router}: {url}: service {match['svc']} is not a headless service of those pods")
    if int(match["i"]) >= target["replicas"]:
        problems.append(f"{router}: {url}: {match['pod']} has {target['replicas']} replica(s)")
    if int(match["port"]) != target["port"]:
        problems.append(f"{router}: {url}: the server listens on {target['port']}")
    if want_role == "prefill" and int(bootstrap or 8998) != target["bootstrap"]:
        problems.append(f"{router}: {url}: bootstrap port {bootstrap} != the server's {target['bootstrap']}")
    return problems


# ---------------------------------------------------------------- resources, probes, security, policies


def parse_quantity(text: str | int) -> int:
    """Kubernetes memory quantity ('256Gi', '512Mi', '8G', 1024) in bytes."""
    match = re.fullmatch(r"(\d+)([KMGTP]i?)?", str(text))
    if not match:
        raise ValueError(f"unsupported quantity {text!r}")
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
             "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}  # fmt: skip
    return int(match.group(1)) * units.get(match.group(2) or "", 1)


def check_resources(objs: list[Obj], gpu: bool) -> list[str]:
    problems = []
    for obj, template, container in workloads(objs):
        where = f"{name_of(obj)} container {container['name']}"
        limits = container.get("resources", {}).get("limits", {})
        requests = container.get("resources", {}).get("requests", {})
        if "memory" not in limits:
            problems.append(f"{where}: no memory limit")
        if role(template) not in SERVER_ROLES:
            continue
        gpus = int(limits.get("nvidia.com/gpu", 0))
        if gpu and gpus < 1:
            problems.append(f"{where}: no nvidia.com/gpu limit")
        if not gpu and gpus:
            problems.append(f"{where}: asks for a GPU in a CPU overlay")
        if int(requests.get("nvidia.com/gpu", gpus)) != gpus:
            problems.append(f"{where}: nvidia.com/gpu request differs from its limit")
        args, _ = expand_args(container, objs)
        ns, _ = parse_cli(args)
        pool = ns.host_kv_budget if ns is not None else None
        tp = ns.tp_size if ns is not None else 1
        shared_pool = bool(pool) and tp > 1 and ns.enable_hisparse and not ns.enable_dp_attention
        staging = shared_pool and ns.disaggregation_mode == "decode"
        # The shared pool (and its PD staging) sits in /dev/shm, which counts against the memory limit.
        in_memory = int(pool * PD_STAGING_SHM_FACTOR) if staging else pool
        if pool and "memory" in limits and parse_quantity(limits["memory"]) < in_memory + 2**30:
            problems.append(f"{where}: memory limit {limits['memory']} does not hold the host KV pool "
                            f"({in_memory} bytes{' with its PD staging' if staging else ''}) plus the process")
        if gpu and tp > gpus:
            problems.append(f"{where}: --tp-size {tp} needs {tp} GPUs, the pod has {gpus}")
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        shm = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        shm_dir = volumes.get(shm[0]["name"], {}).get("emptyDir", {}) if shm else {}
        if shm_dir.get("medium") != "Memory":
            problems.append(f"{where}: /dev/shm is not a memory-backed emptyDir")
        elif shared_pool and parse_quantity(shm_dir.get("sizeLimit", 0)) < in_memory:
            problems.append(f"{where}: /dev/shm ({shm_dir.get('sizeLimit')}) does not hold the shared host KV pool"
                            f"{' and its PD staging' if staging else ''} ({in_memory} bytes: --tp-size {tp} keeps "
                            "them there)")
    return problems


def check_probes(objs: list[Obj], min_startup_s: int) -> list[str]:
    problems = []
    for obj, template, container in workloads(objs):
        where = f"{name_of(obj)} container {container['name']}"
        ready = container.get("readinessProbe", {}).get("httpGet", {})
        if ready.get("path") != "/health":
            problems.append(f"{where}: readiness is not GET /health")
        if "livenessProbe" not in container:
            problems.append(f"{where}: no liveness probe")
        if role(template) in SERVER_ROLES:
            startup = container.get("startupProbe")
            if not startup:
                problems.append(f"{where}: no startup probe (model loading would trip liveness)")
                continue
            budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
            if budget < min_startup_s:
                problems.append(f"{where}: startup probe allows {budget} s < {min_startup_s} s of loading")
        grace = template["spec"].get("terminationGracePeriodSeconds", 30)
        command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        if not command:
            problems.append(f"{where}: no preStop hook")
            continue
        pause = float(command[1]) if command[0] == "sleep" else 0.0
        if "--timeout" in command:
            pause = float(command[command.index("--timeout") + 1])
        drain = [a.split("=", 1)[1] for a in container.get("args", []) if a.startswith("--graceful-shutdown-timeout=")]
        if role(template) in SERVER_ROLES and not drain:
            problems.append(f"{where}: no --graceful-shutdown-timeout (SIGTERM would abort requests in flight)")
        if pause + sum(float(d) for d in drain) >= grace:
            problems.append(f"{where}: preStop + drain wait as long as the grace period ({grace} s)")
    return problems


def check_security(objs: list[Obj], allowed_caps: frozenset[str]) -> list[str]:
    problems = []
    for obj in objs:
        if obj["kind"] == "Secret":
            problems.append(f"{name_of(obj)}: secrets are created by the operator, never kept in manifests")
    for obj, template, container in workloads(objs):
        where = f"{name_of(obj)} container {container['name']}"
        pod = template["spec"]
        if not pod.get("securityContext", {}).get("runAsNonRoot"):
            problems.append(f"{where}: pod not runAsNonRoot")
        if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
            problems.append(f"{where}: uses host namespaces")
        if pod.get("automountServiceAccountToken") is not False:
            problems.append(f"{where}: mounts a service account token")
        sc = container.get("securityContext", {})
        if sc.get("privileged") or sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: privileged or may escalate")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{where}: root filesystem writable")
        caps = sc.get("capabilities", {})
        if caps.get("drop") != ["ALL"]:
            problems.append(f"{where}: does not drop ALL capabilities")
        extra = set(caps.get("add", [])) - allowed_caps
        if extra:
            problems.append(f"{where}: adds capabilities {sorted(extra)}")
        for arg in container.get("args", []):
            if str(arg).startswith("--api-key") and not re.fullmatch(r"--api-key=\$\([A-Z_]+\)", str(arg)):
                problems.append(f"{where}: API key given literally ({arg})")
        env = container_env(container, objs)
        for var in _VAR.findall(" ".join(map(str, container.get("args", [])))):
            if "KEY" in var and not env.get(var, "").startswith("<secret "):
                problems.append(f"{where}: {var} does not come from a Secret")
    return problems


PD_AUTH_SECRET = "hisparse-pd-auth"


def check_pd_auth(objs: list[Obj]) -> list[str]:
    """Issue 25: every prefill, decode and router container reads the deployment's PD secret from a file mounted
    from the operator's Secret, the servers require an API key and the router sends it (both from that Secret)."""
    problems = []
    for obj, template, container in workloads(objs):
        where = f"{name_of(obj)} container {container['name']}"
        args, _ = expand_args(container, objs)
        ns, error = parse_cli(args)
        if ns is None:
            problems.append(f"{where}: {error}")
            continue
        path = getattr(ns, "disaggregation_auth_secret_file", None)
        if ns.command == "serve" and ns.disaggregation_mode == "null":
            continue
        if not path:
            problems.append(f"{where}: no --disaggregation-auth-secret-file (the PD control plane is unauthenticated)")
            continue
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        mounts = [m for m in container.get("volumeMounts", [])
                  if path.startswith(m["mountPath"].rstrip("/") + "/")]  # fmt: skip
        secret = volumes.get(mounts[0]["name"], {}).get("secret", {}) if mounts else {}
        if secret.get("secretName") != PD_AUTH_SECRET or secret.get("optional"):
            problems.append(f"{where}: {path} is not mounted from the Secret {PD_AUTH_SECRET} (required)")
        elif not mounts[0].get("readOnly"):
            problems.append(f"{where}: the PD secret is mounted writable")
        elif secret.get("defaultMode", 0o644) & 0o007:
            problems.append(f"{where}: the PD secret file is readable by others (defaultMode {secret.get('defaultMode')})")
        env = container_env(container, objs)
        key_flag = "--api-key" if ns.command == "serve" else "--worker-api-key"
        given = [a for a in container.get("args", []) if str(a).startswith(key_flag + "=")]
        var = _VAR.findall(given[0]) if given else []
        if not var or env.get(var[0]) != f"<secret {PD_AUTH_SECRET}/worker-api-key>":
            problems.append(f"{where}: {key_flag} does not come from the Secret {PD_AUTH_SECRET}")
    return problems


def check_pdbs(objs: list[Obj]) -> list[str]:
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    problems = []
    for obj in objs:
        for template in pod_templates(obj):
            covering = [p for p in pdbs if _selects(p["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])]
            if len(covering) != 1:
                problems.append(f"{name_of(obj)}: covered by {len(covering)} PodDisruptionBudgets")
    return problems


# Network policies: a small evaluator of the ingress rules we use (podSelector/namespaceSelector matchLabels,
# ports with endPort), and the expected reachability.


def _peer_matches(peer: Obj, src_labels: dict[str, str] | None, src_ns: str, policy_ns: str) -> bool:
    ns_sel = peer.get("namespaceSelector")
    pod_sel = peer.get("podSelector")
    if ns_sel is not None:
        ns_ok = _selects(ns_sel.get("matchLabels", {}), {"kubernetes.io/metadata.name": src_ns})
    else:
        ns_ok = src_ns == policy_ns
    pod_ok = pod_sel is None or (src_labels is not None and _selects(pod_sel.get("matchLabels", {}), src_labels))
    return ns_ok and pod_ok


def _port_matches(rule_port: Obj, port: int) -> bool:
    start = rule_port["port"]
    return start <= port <= rule_port.get("endPort", start)


def allowed(objs: list[Obj], src_labels: dict[str, str] | None, src_ns: str, dst_labels: dict[str, str],
            dst_ns: str, port: int) -> bool:  # fmt: skip
    policies = [p for p in objs if p["kind"] == "NetworkPolicy" and p["metadata"].get("namespace") == dst_ns
                and _selects(p["spec"]["podSelector"].get("matchLabels", {}), dst_labels)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]  # fmt: skip
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            if peers is not None and not any(
                _peer_matches(peer, src_labels, src_ns, dst_ns) for peer in peers
            ):
                continue
            ports = rule.get("ports")
            if ports is None or any(_port_matches(p, port) for p in ports):
                return True
    return False


def check_network_policies(objs: list[Obj]) -> list[str]:
    servers = server_ports(objs)
    ns = next(o["metadata"]["namespace"] for o in objs if o["kind"] == "NetworkPolicy")
    labels = {info["role"]: info["labels"] for info in servers.values()}
    http = {r: next(i["port"] for i in servers.values() if i["role"] == r) for r in labels}
    bootstrap = next(i["bootstrap"] for i in servers.values() if i["role"] == "prefill")
    transfer_ports = (15000, 16999, 49152, 65535)  # mooncake RPC range, ZMQ's random-port range
    other_pod = {"app": "something-else"}
    expect = [
        ("anyone -> router", other_pod, "default", "router", http["router"], True),
        ("router -> prefill http", labels["router"], ns, "prefill", http["prefill"], True),
        ("router -> decode http", labels["router"], ns, "decode", http["decode"], True),
        ("monitoring -> prefill http", other_pod, "monitoring", "prefill", http["prefill"], True),
        ("monitoring -> decode http", other_pod, "monitoring", "decode", http["decode"], True),
        ("decode -> prefill bootstrap", labels["decode"], ns, "prefill", bootstrap, True),
        ("other pod -> prefill http", other_pod, ns, "prefill", http["prefill"], False),
        ("other namespace -> decode http", other_pod, "default", "decode", http["decode"], False),
        ("decode -> prefill http", labels["decode"], ns, "prefill", http["prefill"], False),
        ("prefill -> decode http", labels["prefill"], ns, "decode", http["decode"], False),
        ("router -> prefill bootstrap", labels["router"], ns, "prefill", bootstrap, False),
        ("monitoring -> prefill bootstrap", other_pod, "monitoring", "prefill", bootstrap, False),
        ("other pod -> prefill bootstrap", other_pod, ns, "prefill", bootstrap, False),
    ]
    for port in transfer_ports:
        expect += [
            (f"decode -> prefill transfer :{port}", labels["decode"], ns, "prefill", port, True),
            (f"prefill -> decode transfer :{port}", labels["prefill"], ns, "decode", port, True),
            (f"router -> decode transfer :{port}", labels["router"], ns, "decode", port, False),
            (f"other namespace -> prefill transfer :{port}", other_pod, "default", "prefill", port, False),
        ]
    problems = []
    for what, src, src_ns, dst_role, port, want in expect:
        got = allowed(objs, src, src_ns, labels[dst_role], ns, port)
        if got != want:
            problems.append(f"{what}: {'allowed' if got else 'blocked'}, expected {'allowed' if want else 'blocked'}")
    return problems


def mutated(objs: list[Obj]) -> list[Obj]:
    return copy.deepcopy(objs)
