"""The Dockerfile (hadolint, and what the image must contain), compose (schema, flags, ports, health
dependencies) and yamllint over deploy/. Each check also fails on a broken copy."""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_checks import REPO, docker_context_paths, parse_cli, run_tool

DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "deploy" / "compose" / "compose.yaml"


def hadolint(path: Path) -> tuple[int, str]:
    out = run_tool("hadolint", "--no-color", str(path))
    return out.returncode, out.stdout + out.stderr


def test_dockerfile_is_hadolint_clean() -> None:
    code, text = hadolint(DOCKERFILE)
    assert code == 0, text


def test_hadolint_catches_violations(tmp_path: Path) -> None:
    text = DOCKERFILE.read_text()
    broken = tmp_path / "Dockerfile"
    broken.write_text(text.replace("# hadolint ignore=DL3008\n", "", 1))  # unpinned apt packages, unjustified
    code, out = hadolint(broken)
    assert code != 0 and "DL3008" in out
    broken.write_text(text + "USER root\n")  # the image would end up running as root
    code, out = hadolint(broken)
    assert code != 0 and "DL3002" in out


def dockerfile_stages(text: str) -> dict[str, list[str]]:
    """Instructions per stage (continuation lines joined, comments dropped)."""
    stages: dict[str, list[str]] = {}
    current = None
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = match.group(1)
            stages[current] = []
        if current:
            stages[current].append(line)
    return stages


# System packages of the libraries mooncake's transfer engine links (the image test checks them all with ldd).
RUNTIME_PACKAGES = ("libibverbs1", "libnuma1", "libcurl4")


def image_problems(text: str) -> list[str]:
    problems = []
    stages = dockerfile_stages(text)
    if re.match(r"(\s*#[^\n]*\n)*\s*#\s*syntax\s*=", text, re.IGNORECASE):
        problems.append("a `# syntax=` directive: BuildKit would fetch its frontend from a registry")
    bases = set(re.findall(r"^ARG (\w+)=", text.split("\nFROM ", 1)[0], re.MULTILINE))
    for stage, lines in stages.items():
        base = lines[0].split()[1]
        if base not in stages and not (base.startswith("${") and base[2:-1] in bases):
            problems.append(f"{stage}: FROM {base} is neither a build argument nor a stage")
    if not re.search(r"^ARG BASE_IMAGE=nvidia/cuda:\S+-runtime-", text, re.MULTILINE):
        problems.append("no ARG BASE_IMAGE defaulting to a CUDA runtime image")
    if list(stages)[-1] != "cuda" or "FROM ${BASE_IMAGE} AS cuda" not in stages["cuda"][0]:
        problems.append("the default (last) target is not the CUDA runtime on ${BASE_IMAGE}")
    for target in ("cpu", "cuda"):
        lines = stages.get(target, [])
        joined = "\n".join(lines)
        users = [line.split()[1] for line in lines if line.startswith("USER ")]
        if not users or users[-1] in ("root", "0"):
            problems.append(f"{target}: does not run as a non-root user")
        if not re.search(r"^EXPOSE .*\b30000\b", joined, re.MULTILINE):
            problems.append(f"{target}: does not EXPOSE 30000")
        if not re.search(r"^HEALTHCHECK .*decode_server\.ops.*probe", joined, re.MULTILINE):
            problems.append(f"{target}: no HEALTHCHECK on /health")
        if 'ENTRYPOINT ["decode-server"]' not in lines:
            problems.append(f"{target}: entrypoint is not decode-server")
        if not re.search(r"pip install .*wheel-name\.txt\)\[\$\{EXTRAS\}\]", joined):
            problems.append(f"{target}: does not install the project's wheel with its extras")
        if re.search(r"(API_KEY|TOKEN|PASSWORD|SECRET)\S*=", joined):
            problems.append(f"{target}: a secret-looking value is baked in")
        apt = " ".join(line for line in lines if "apt-get install" in line).split()
        for package in RUNTIME_PACKAGES:
            if package not in apt:
                problems.append(f"{target}: does not install {package}")
        if "python -m decode_server.ops check-libs" not in joined:
            problems.append(f"{target}: does not check the libraries its wheels link (ops check-libs)")
    if "python -m decode_server.ops build-kernels" not in "\n".join(stages.get("cuda-build", [])):
        problems.append("the CUDA extension is not built at image build time")
    if "COPY --from=cuda-build /opt/hisparse/kernels" not in "\n".join(stages.get("cuda", [])):
        problems.append("the CUDA image does not carry the prebuilt kernels")
    return problems


def context_problems(admitted: list[str]) -> list[str]:
    """The build context must hold what the wheel is built from: pyproject's packages and files."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = [p.rstrip("*").rstrip(".") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    needed = ["pyproject.toml", pyproject["project"]["readme"], "configs", *packages]
    return [f".dockerignore keeps {name} out of the build context" for name in needed if name not in admitted]


def test_image_contents() -> None:
    assert image_problems(DOCKERFILE.read_text()) == []
    assert (REPO / ".dockerignore").read_text().splitlines().count("*") == 1  # an allowlist
    assert context_problems(docker_context_paths()) == []


def test_image_check_catches_mistakes() -> None:
    text = DOCKERFILE.read_text()
    assert "cpu: does not run as a non-root user" in image_problems(text.replace("USER 10001", "USER root", 1))
    assert "the CUDA extension is not built at image build time" in image_problems(
        text.replace("python -m decode_server.ops build-kernels", "true"))
    assert "cuda: a secret-looking value is baked in" in image_problems(text + "ENV DECODE_SERVER_API_KEY=sk-1\n")
    assert "cpu: does not install libcurl4" in image_problems(text.replace("libnuma1 libcurl4", "libnuma1", 1))
    assert "a `# syntax=` directive: BuildKit would fetch its frontend from a registry" in image_problems(
        "# syntax=docker/dockerfile:1\n" + text)
    assert "wheel: FROM python:3.11-slim is neither a build argument nor a stage" in image_problems(
        text.replace("FROM ${CPU_BASE_IMAGE} AS wheel", "FROM python:3.11-slim AS wheel"))
    assert "cuda: does not check the libraries its wheels link (ops check-libs)" in image_problems(
        text.replace("check-libs --allow-driver", "--help"))
    admitted = [p for p in docker_context_paths() if p != "kernels"]
    assert context_problems(admitted) == [".dockerignore keeps kernels out of the build context"]


def test_yamllint_clean() -> None:
    out = run_tool("yamllint", "--strict", "deploy/", ".yamllint.yaml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_yamllint_catches_errors(tmp_path: Path) -> None:
    shutil.copy(REPO / ".yamllint.yaml", tmp_path / ".yamllint.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\nb:  [1, 2]   \na: 2\n")  # duplicate key, trailing spaces
    out = run_tool("yamllint", "--strict", "bad.yaml", cwd=tmp_path)
    assert out.returncode != 0 and "duplicate" in out.stdout and "trailing-spaces" in out.stdout


# ---------------------------------------------------------------- compose

_INTERPOLATION = re.compile(r"\$\{([A-Z_]+)(?::?[-?]([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} / ${VAR:?message} with no variable set: the default, or a placeholder."""
    return _INTERPOLATION.sub(lambda m: "<from environment>" if "?" in m.group(0) else (m.group(2) or ""), value)


def compose_problems(compose: dict[str, Any]) -> list[str]:
    problems = []
    services = compose["services"]
    for name, svc in services.items():
        args = [interpolate(str(a)) for a in svc["command"]]
        ns, error = parse_cli(args)
        if error:
            problems.append(f"{name}: {args}: {error}")
            continue
        health = " ".join(svc["healthcheck"]["test"])
        if f"http://127.0.0.1:{ns.port}/health" not in health:
            problems.append(f"{name}: healthcheck does not probe its own port {ns.port}")
        gpu = "gpu" in svc.get("profiles", [])
        reserved = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if gpu and ns.command == "serve" and not any("gpu" in d.get("capabilities", []) for d in reserved):
            problems.append(f"{name}: GPU profile service reserves no GPU")
        if not gpu and reserved:
            problems.append(f"{name}: the default (CPU) services must not need a GPU")
        if svc.get("read_only") is not True or svc.get("cap_drop") != ["ALL"]:
            problems.append(f"{name}: not read-only with all capabilities dropped")
        problems += [f"{name}: {p}" for p in tmpfs_problems(svc.get("tmpfs", []))]
        secret = ns.disaggregation_auth_secret_file or ""
        if not (secret.startswith("/run/secrets/") and secret.rsplit("/", 1)[1] in svc.get("secrets", [])
                and secret.rsplit("/", 1)[1] in compose.get("secrets", {})):  # fmt: skip
            problems.append(f"{name}: the PD secret is not a compose secret (--disaggregation-auth-secret-file "
                            f"{secret or 'missing'})")
        for used in svc.get("secrets", []):
            # Compose copies an `environment:` (or `content:`) secret into the container, which a read-only
            # container refuses at `up` ("`file` is the sole supported option"); a `file:` one is bind-mounted.
            source = compose.get("secrets", {}).get(used, {})
            if svc.get("read_only") and "file" not in source:
                problems.append(f"{name}: secret {used} of a read-only service must be a `file:` secret "
                                f"(has {sorted(source) or 'no source'})")
        if ns.command != "router":
            if svc.get("ports"):
                problems.append(f"{name}: publishes a worker port to the host")
            continue
        for dep, spec in svc.get("depends_on", {}).items():
            if spec.get("condition") != "service_healthy":
                problems.append(f"{name}: depends on {dep} without condition service_healthy")
        workers = [(v[0], v[1] if len(v) > 1 else "8998") for v in ns.prefill] + [(u, None) for u in ns.decode]
        for url, bootstrap in workers:
            match = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url)
            target = services.get(match.group(1)) if match else None
            if target is None:
                problems.append(f"{name}: {url} names no service")
                continue
            if match.group(1) not in svc.get("depends_on", {}):
                problems.append(f"{name}: does not wait for {match.group(1)} to be healthy")
            if set(svc.get("profiles", [])) != set(target.get("profiles", [])):
                problems.append(f"{name}: routes to {match.group(1)} of another profile")
            target_ns, _ = parse_cli([interpolate(str(a)) for a in target["command"]])
            if target_ns is not None and int(match.group(2)) != target_ns.port:
                problems.append(f"{name}: {url} but {match.group(1)} listens on {target_ns.port}")
            if bootstrap and target_ns is not None and int(bootstrap) != target_ns.disaggregation_bootstrap_port:
                problems.append(f"{name}: bootstrap port {bootstrap} != {match.group(1)}'s")
    return problems


IMAGE_UID = "10001"
CACHE_DIR = "/var/cache/hisparse"  # the image's $HISPARSE_CACHE_DIR (the tiny-dsa checkpoint, Triton's cache)


def tmpfs_problems(mounts: list[str] | str) -> list[str]:
    """Docker mounts a tmpfs as root 0755, noexec: one the server writes must be given to the image's user, and
    the cache must allow exec (Triton loads the launchers it compiles there). /tmp is made world-writable."""
    problems = []
    for mount in [mounts] if isinstance(mounts, str) else mounts:
        path, _, options = mount.partition(":")
        opts = dict(o.partition("=")[::2] for o in options.split(",") if o)
        if path != "/tmp" and opts.get("uid") != IMAGE_UID and not opts.get("mode", "").endswith("777"):
            problems.append(f"tmpfs {path} is not writable by uid {IMAGE_UID} (root 0755 by default)")
        if path == CACHE_DIR and "exec" not in opts:
            problems.append(f"tmpfs {path} is noexec (Triton cannot load what it compiles)")
    return problems


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_matches_the_compose_spec() -> None:
    out = run_tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE))
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_schema_catches_bad_fields(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yaml"
    bad.write_text(COMPOSE.read_text().replace("    depends_on:\n", "    depends:\n", 1))
    out = run_tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(bad))
    assert out.returncode != 0 and "depends" in out.stdout


def test_compose_services_are_consistent(compose: dict[str, Any]) -> None:
    assert {"prefill", "decode", "router"} <= set(compose["services"])
    assert all("profiles" not in compose["services"][s] for s in ("prefill", "decode", "router"))
    assert compose_problems(compose) == []


def test_compose_check_catches_mistakes(compose: dict[str, Any]) -> None:
    import copy

    broken = copy.deepcopy(compose)
    broken["services"]["router"]["depends_on"]["decode"]["condition"] = "service_started"
    assert "router: depends on decode without condition service_healthy" in compose_problems(broken)
    broken = copy.deepcopy(compose)
    broken["services"]["decode"]["healthcheck"]["test"][-1] = "http://127.0.0.1:30001/health"
    assert "decode: healthcheck does not probe its own port 30000" in compose_problems(broken)
    broken = copy.deepcopy(compose)
    broken["services"]["prefill"]["tmpfs"] = ["/tmp", CACHE_DIR]
    assert f"prefill: tmpfs {CACHE_DIR} is not writable by uid 10001 (root 0755 by default)" in compose_problems(
        broken)
    assert f"prefill: tmpfs {CACHE_DIR} is noexec (Triton cannot load what it compiles)" in compose_problems(broken)
    broken = copy.deepcopy(compose)
    del broken["services"]["decode-gpu"]["deploy"]
    assert "decode-gpu: GPU profile service reserves no GPU" in compose_problems(broken)
    broken = copy.deepcopy(compose)
    broken["services"]["router"]["command"][broken["services"]["router"]["command"].index("http://decode:30000")] = (
        "http://decode-gpu:30000")
    assert "router: routes to decode-gpu of another profile" in compose_problems(broken)
    broken = copy.deepcopy(compose)
    broken["services"]["prefill"]["command"] = [a for a in broken["services"]["prefill"]["command"]
                                                if not a.startswith("--disaggregation-auth-secret-file")]  # fmt: skip
    assert "prefill: the PD secret is not a compose secret (--disaggregation-auth-secret-file missing)" in \
        compose_problems(broken)  # fmt: skip
    broken = copy.deepcopy(compose)
    broken["services"]["router"]["secrets"] = []
    assert any(p.startswith("router: the PD secret is not a compose secret") for p in compose_problems(broken))
    broken = copy.deepcopy(compose)
    broken["secrets"]["pd_auth"] = {"environment": "HISPARSE_PD_AUTH_SECRET"}
    assert "decode: secret pd_auth of a read-only service must be a `file:` secret (has ['environment'])" in \
        compose_problems(broken)  # fmt: skip
