"""The files in `cluster/` read as text (issue 13: what a real cluster is built and exposed from).

- every image (`FROM` in the Dockerfiles, `image:` in docker-compose, the KubeRay manifests
  and the launcher config) is pinned to an exact version or a digest: no `latest`, no
  missing tag, no `nightly`, no tag that names only a major or minor line (`postgres:16`,
  `python:3.11-slim`), which moves under the same name;
- MLflow listens on the loopback unless told otherwise: the compose file publishes it on
  127.0.0.1 only, the start script's default host is 127.0.0.1 (run with a stand-in
  python that records the server's arguments), and the Kubernetes Services are ClusterIP;
- the images install their Python dependencies from hash-locked files (cluster/lock.sh
  writes them) and nothing unpinned besides: `pip install --require-hashes -r LOCK`, the
  project itself with `--no-deps`;
- the node image's lock pins every direct dependency of pyproject.toml (and the
  dependencies of the extras it asks for) to one version with hashes, and the versions
  agree everywhere: the Ray image tag, `rayVersion` of the KubeRay manifests, the MLflow
  server's lock, and the driver's own installed Ray and MLflow;
- the README tells how to put MLflow behind TLS and which variables the clients read.

No Docker, Kubernetes or network here: tests/test_cluster.py runs the services.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO_ROOT = Path(__file__).resolve().parents[1]
CLUSTER = REPO_ROOT / "cluster"
NODE_DOCKERFILE = CLUSTER / "Dockerfile"
MLFLOW_DOCKERFILE = CLUSTER / "mlflow" / "Dockerfile"
NODE_LOCK = CLUSTER / "requirements.lock"
MLFLOW_LOCK = CLUSTER / "mlflow" / "requirements.lock"
COMPOSE = CLUSTER / "mlflow" / "docker-compose.yaml"
START_SCRIPT = CLUSTER / "mlflow" / "start-mlflow-server.sh"
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


# ----------------------------------------------------------------------------- images

# Tags that name a moving target whatever comes with them.
FLOATING_WORDS = {
    "latest",
    "nightly",
    "edge",
    "stable",
    "main",
    "master",
    "dev",
    "rolling",
    "current",
    "mainline",
    "lts",
}
# Images whose releases have two numbers (PostgreSQL 16.15 is one exact release).
TWO_PART_VERSIONS = {"postgres", "library/postgres", "docker.io/library/postgres"}
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def split_image(ref: str) -> tuple[str, str | None, str | None]:
    """`repo[:tag][@digest]` -> (repo, tag, digest); a registry's :port is not a tag."""
    ref, _, digest = ref.partition("@")
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        return ref[:colon], ref[colon + 1 :], digest or None
    return ref, None, digest or None


def floating_reason(ref: str) -> str | None:
    """Why `ref` can name different images over time, or None when it is pinned."""
    if "$" in ref:
        return "an unresolved variable"
    repo, tag, digest = split_image(ref)
    if digest is not None and not DIGEST.fullmatch(digest):
        return f"a malformed digest {digest!r}"
    if tag is None:
        return "no tag (Docker reads it as `latest`)" if digest is None else None
    words = set(re.split(r"[-_.]", tag.lower()))
    if words & FLOATING_WORDS or "nightly" in tag.lower() or "latest" in tag.lower():
        return f"the floating tag {tag!r}"
    if digest is not None:
        return None  # content-addressed: the digest decides, the tag is a label
    if re.search(r"(?<![\d.])\d+\.\d+\.\d+(?![\d.])", tag) or re.match(r"RELEASE\.\d{4}-", tag):
        return None
    if repo in TWO_PART_VERSIONS and re.match(r"\d+\.\d+(?![\d.])", tag):
        return None
    return f"the tag {tag!r} names no exact release"


def _dockerfiles() -> list[Path]:
    return sorted(p for p in CLUSTER.rglob("Dockerfile*") if not p.name.endswith("ignore"))


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def _substitute(text: str, args: dict[str, str]) -> str:
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        return args.get(name, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def dockerfile_images(path: Path) -> list[str]:
    """Every base image of a Dockerfile, ARG defaults substituted (build stages left out)."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    images = []
    for word, rest in _instructions(path):
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name.strip()] = _substitute(default.strip().strip("\"'"), args)
        elif word == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--")]
            image = _substitute(parts[0], args)
            if len(parts) >= 3 and parts[1].lower() == "as":
                stages.add(parts[2].lower())
            if image.lower() not in stages and image != "scratch":
                images.append(image)
    return images


def _yaml_images(node, where: str):
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, str) and (key == "image" or key.endswith("_image")):
                yield where, value
            else:
                yield from _yaml_images(value, where)
    elif isinstance(node, list):
        for item in node:
            yield from _yaml_images(item, where)


def all_images() -> list[tuple[str, str]]:
    found = [(str(p.relative_to(REPO_ROOT)), image) for p in _dockerfiles() for image in dockerfile_images(p)]
    for path in sorted(CLUSTER.rglob("*.yaml")) + sorted(CLUSTER.rglob("*.yml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found.extend(_yaml_images(doc, str(path.relative_to(REPO_ROOT))))
    return found


@pytest.mark.parametrize(
    "ref, pinned",
    [
        ("postgres", False),
        ("postgres:latest", False),
        ("postgres:16", False),
        ("postgres:16-alpine", False),
        ("postgres:16.15", True),
        ("postgres:16.15-trixie", True),
        ("python:3.11-slim", False),
        ("python:3.11.17-slim-trixie", True),
        ("rayproject/ray:nightly-py311-gpu", False),
        ("rayproject/ray:2.60.0-py311-gpu", True),
        ("quay.io/minio/minio:latest", False),
        ("quay.io/minio/minio:RELEASE.2025-09-07T16-13-09Z", True),
        ("localhost:5000/studies", False),
        ("localhost:5000/studies:1.2.3", True),
        ("ghcr.io/your-org/setvalued-studies:latest", False),
        ("caddy@sha256:" + "0" * 64, True),
        ("caddy:latest@sha256:" + "0" * 64, False),
        ("caddy@sha256:abc", False),
        ("${RAY_IMAGE}", False),
    ],
)
def test_floating_tag_check(ref, pinned):
    """The check below is able to fail: it knows the floating forms."""
    assert (floating_reason(ref) is None) == pinned, (ref, floating_reason(ref))


def test_dockerfile_images_resolve_arg_defaults(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text("ARG BASE=python:3.11\nFROM ${BASE} AS build\nFROM build\nFROM --platform=linux/amd64 caddy\n")
    assert dockerfile_images(path) == ["python:3.11", "caddy"]


def test_every_image_is_pinned():
    images = all_images()
    assert len(images) >= 8, images  # both Dockerfiles, compose, manifests, launcher
    bad = [f"{where}: {image} ({reason})" for where, image in images if (reason := floating_reason(image))]
    assert not bad, "floating images:\n" + "\n".join(bad)


# ----------------------------------------------------------------------------- MLflow on the loopback


def _published(port) -> tuple[str | None, str, str]:
    """(host_ip, published, target) of a compose `ports` entry (short or long syntax)."""
    if isinstance(port, dict):
        return port.get("host_ip"), str(port.get("published", "")), str(port["target"])
    text = str(port).split("/")[0]
    if text.startswith("["):  # [::1]:5000:5000
        host, _, rest = text[1:].partition("]:")
        published, _, target = rest.rpartition(":")
        return host, published, target
    parts = text.split(":")
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    if len(parts) == 2:
        return None, parts[0], parts[1]
    return None, "", parts[0]


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment", {}) or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: str(v) for k, v in env.items()}


def test_compose_publishes_mlflow_on_the_loopback_only():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    mlflow = services["mlflow"]
    ports = [_published(p) for p in mlflow.get("ports", [])]
    assert ports, "the mlflow service publishes no port"
    for host, published, target in ports:
        assert host in LOOPBACK, f"mlflow publishes {published}:{target} on {host or 'every interface'}"
    # Inside its container the server must listen on the container's interface, or the
    # loopback mapping above reaches nothing: the compose file says so explicitly.
    assert _env(mlflow).get("MLFLOW_HOST") == "0.0.0.0"
    # Nothing else is published beyond the loopback but TLS (the optional proxy, :443).
    for name, service in services.items():
        for host, published, target in map(_published, service.get("ports", []) or []):
            if host not in LOOPBACK:
                assert target == "443", (
                    f"{name} publishes {published}:{target} on {host or 'every interface'} without TLS"
                )


def _run_start_script(tmp_path: Path, **env: str) -> list[str]:
    """The arguments the start script passes to `python -m mlflow`, with a stand-in python."""
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))  # one record per run
    record = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\ncat > /dev/null\nprintf "%s\\n" CALL "$@" >> {shlex.quote(str(record))}\n')
    fake.chmod(0o755)
    base = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "TMPDIR": str(tmp_path),
        "PYTHON": str(fake),
        "MLFLOW_DB_HOST": "db.invalid",
        "MLFLOW_DB_USER": "mlflow",
        "PGPASSWORD": "not-a-password",
        "MLFLOW_AUTH_ADMIN_PASSWORD": "not-a-password-1",
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "not-a-key",
        "MLFLOW_ARTIFACTS_DESTINATION": str(tmp_path / "artifacts"),
    }
    result = subprocess.run(
        ["bash", str(START_SCRIPT)],
        env={**base, **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    calls = record.read_text().split("CALL\n")[1:]
    server = [c.splitlines() for c in calls if c.startswith("-m\nmlflow\n")]
    assert len(server) == 1, calls
    return server[0]


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_start_script_listens_on_the_loopback_by_default(tmp_path):
    args = _run_start_script(tmp_path)
    assert _option(args, "--host") == "127.0.0.1"
    # the documented default says the same
    assert re.search(r"MLFLOW_HOST \(127\.0\.0\.1\)", START_SCRIPT.read_text())
    # and a deployment that means every interface says so
    assert _option(_run_start_script(tmp_path, MLFLOW_HOST="0.0.0.0"), "--host") == "0.0.0.0"


def _kube_docs() -> list[dict]:
    return [
        doc
        for path in sorted((CLUSTER / "kuberay").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def test_kubernetes_services_are_cluster_internal():
    services = [d for d in _kube_docs() if d["kind"] == "Service"]
    assert any(s["metadata"]["name"] == "mlflow" for s in services)
    for service in services:
        kind = service["spec"].get("type", "ClusterIP")
        assert kind == "ClusterIP", f"Service {service['metadata']['name']} is a {kind}"
    for ingress in (d for d in _kube_docs() if d["kind"] == "Ingress"):
        assert ingress["spec"].get("tls"), f"Ingress {ingress['metadata']['name']} without TLS"


def test_kubernetes_mlflow_pod_says_where_it_listens():
    """The script's default is the loopback: the pod behind the Service must ask for more."""
    deployment = next(d for d in _kube_docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env.get("MLFLOW_HOST") == "0.0.0.0"


# ----------------------------------------------------------------------------- locked installs


def _pip_installs(path: Path) -> list[list[str]]:
    """The argument lists of every `pip install` run by a Dockerfile (ARG defaults applied)."""
    args: dict[str, str] = {}
    installs = []
    for word, rest in _instructions(path):
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip("\"'")
        if word != "RUN":
            continue
        lexer = shlex.shlex(_substitute(rest, args), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands: list[list[str]] = [[]]
        for token in lexer:  # split the shell line at && || ; | ( )
            if token and set(token) <= set("&|;()"):
                commands.append([])
            else:
                commands[-1].append(token)
        for words in commands:
            for i in range(len(words) - 1):
                if (
                    re.fullmatch(r"(\S*/)?pip3?", words[i])
                    and words[i + 1] == "install"
                    or words[i : i + 4] == ["python", "-m", "pip", "install"]
                ):
                    start = i + (2 if words[i + 1] == "install" else 4)
                    installs.append(words[start:])
                    break
    return installs


def _copied_to(path: Path, destination_name: str) -> str | None:
    """The source of the COPY whose destination ends with `destination_name`."""
    args: dict[str, str] = {}
    for word, rest in _instructions(path):
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip("\"'")
        if word == "COPY":
            parts = [p for p in _substitute(rest, args).split() if not p.startswith("--")]
            if len(parts) == 2 and parts[1].endswith(destination_name):
                return parts[0]
    return None


@pytest.mark.parametrize(
    "dockerfile, lock, context",
    [
        (NODE_DOCKERFILE, NODE_LOCK, REPO_ROOT),
        (MLFLOW_DOCKERFILE, MLFLOW_LOCK, MLFLOW_DOCKERFILE.parent),
    ],
)
def test_dockerfile_installs_from_the_lock_file(dockerfile, lock, context):
    installs = _pip_installs(dockerfile)
    assert installs, f"{dockerfile}: no pip install"
    locked = [a for a in installs if "--require-hashes" in a and "-r" in a]
    assert locked, f"{dockerfile}: no `pip install --require-hashes -r LOCK`"
    for args in installs:
        if args in locked:
            continue
        # anything else installs no dependency: the project itself, --no-deps, no index
        assert "--no-deps" in args and "--no-index" in args, f"{dockerfile}: unlocked install {args}"
    # the file given to -r is the lock file of the repository, copied into the image
    for args in locked:
        target = args[args.index("-r") + 1]
        source = _copied_to(dockerfile, Path(target).name)
        assert source is not None, f"{dockerfile}: {target} is not COPY'd into the image"
        assert (context / source).resolve() == lock.resolve(), (source, lock)
    # and the build context lets it through (BuildKit reads <Dockerfile>.dockerignore first)
    rel = str(lock.relative_to(context))
    for ignore in (dockerfile.with_name(dockerfile.name + ".dockerignore"), context / ".dockerignore"):
        if ignore.exists():
            excluded = False
            for pattern in ignore.read_text().splitlines():
                pattern = pattern.strip()
                if not pattern or pattern.startswith("#"):
                    continue
                negate = pattern.startswith("!")
                pattern = pattern.lstrip("!")
                if fnmatch.fnmatch(rel, pattern) or pattern == "**":
                    excluded = not negate
            assert not excluded, f"{ignore} keeps {rel} out of the build context"
            break


def parse_lock(path: Path) -> dict[str, tuple[Version, int]]:
    """{canonical name: (version, number of hashes)} of a requirements lock file."""
    assert path.is_file(), f"no lock file {path.relative_to(REPO_ROOT)} (cluster/lock.sh writes it)"
    pins: dict[str, tuple[Version, int]] = {}
    current = None
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not line[0].isspace():
            requirement = Requirement(stripped.rstrip("\\").strip().split(" --hash")[0])
            specs = list(requirement.specifier)
            assert len(specs) == 1 and specs[0].operator == "==", f"{path}: {stripped}"
            current = canonicalize_name(requirement.name)
            assert current not in pins, f"{path}: {current} pinned twice"
            pins[current] = (Version(specs[0].version), 0)
        for digest in re.findall(r"--hash=sha256:([0-9a-f]+)", stripped):
            assert len(digest) == 64 and current is not None, f"{path}: {stripped}"
            version, count = pins[current]
            pins[current] = (version, count + 1)
    return pins


def _hashless(pins: dict[str, tuple[Version, int]]) -> list[str]:
    return [name for name, (_, count) in pins.items() if count == 0]


def _project_dependencies() -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in project["dependencies"]]


def test_lock_pins_every_direct_dependency_with_hashes():
    pins = parse_lock(NODE_LOCK)
    assert not _hashless(pins), f"{NODE_LOCK.name}: no hash for {_hashless(pins)}"
    for requirement in _project_dependencies():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{NODE_LOCK.name} does not pin {requirement}"
        version = pins[name][0]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{NODE_LOCK.name} pins {name}=={version}, outside {requirement}"
        )
        # the extras' dependencies too (read from the installed distribution's metadata
        # when it is the locked version)
        if requirement.extras and _installed(name) == version:
            for text in metadata.requires(requirement.name) or []:
                dependency = Requirement(text)
                if dependency.marker is None:
                    continue
                wanted = any(dependency.marker.evaluate({"extra": extra}) for extra in requirement.extras)
                if wanted:
                    assert canonicalize_name(dependency.name) in pins, (
                        f"{NODE_LOCK.name} lacks {dependency.name} ({name}{requirement.extras})"
                    )


def _installed(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


def test_lock_parser_refuses_loose_lines(tmp_path):
    path = tmp_path / "requirements.lock"
    path.write_text("numpy>=1.24 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    with pytest.raises(AssertionError):
        parse_lock(path)


def test_mlflow_server_lock_matches_the_node_lock():
    server = parse_lock(MLFLOW_LOCK)
    node = parse_lock(NODE_LOCK)
    assert not _hashless(server), f"{MLFLOW_LOCK.name}: no hash for {_hashless(server)}"
    for name in ("mlflow", "psycopg2-binary", "boto3", "flask-wtf"):  # flask-wtf: mlflow[auth]
        assert name in server, f"{MLFLOW_LOCK.name} lacks {name}"
    assert server["mlflow"][0] == node["mlflow"][0], "server and clients run different MLflow"


def _ray_image_version() -> Version:
    images = dockerfile_images(NODE_DOCKERFILE)
    assert len(images) == 1, images
    repo, tag, _ = split_image(images[0])
    assert repo.endswith("rayproject/ray") and tag, images[0]
    match = re.match(r"(\d+\.\d+\.\d+)-py(\d)(\d+)", tag)
    assert match, f"{images[0]}: expected rayproject/ray:X.Y.Z-pyNNN[-gpu]"
    python = f"{match.group(2)}.{match.group(3)}"
    assert python == _lock_python(NODE_LOCK), (images[0], _lock_python(NODE_LOCK))
    return Version(match.group(1))


def _lock_python(path: Path) -> str:
    match = re.search(r"--python-version[ =](\d+\.\d+)", path.read_text())
    assert match, f"{path}: the header names no --python-version"
    return match.group(1)


def test_versions_agree_across_images_manifests_and_the_driver():
    pins = {name: version for name, (version, _) in parse_lock(NODE_LOCK).items()}
    ray = pins["ray"]
    assert _ray_image_version() == ray, "the Ray image and the locked ray differ"
    for doc in _kube_docs():
        spec = doc.get("spec", {})
        spec = spec.get("rayClusterSpec", spec) if doc["kind"] == "RayJob" else spec
        if doc["kind"] in ("RayCluster", "RayJob"):
            assert Version(spec["rayVersion"]) == ray, (doc["metadata"]["name"], ray)
    # the MLflow server image runs the lock's Python
    (python_image,) = dockerfile_images(MLFLOW_DOCKERFILE)
    assert split_image(python_image)[1].startswith(_lock_python(MLFLOW_LOCK) + "."), python_image
    # the driver's installed Ray and MLflow are compared with the lock by `studies submit`'s
    # own check at run time, not here: a new release on the package index must not fail the
    # tests of an unchanged checkout


# ----------------------------------------------------------------------------- README


def test_readme_explains_tls_and_the_client_settings():
    text = (CLUSTER / "README.md").read_text()
    for needle in (
        "TLS",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_SERVER_CERT_PATH",
        "MLFLOW_TRACKING_INSECURE_TLS",
        "Ingress",
        "127.0.0.1:5000:5000",
        "cluster/lock.sh",
        "--require-hashes",
    ):
        assert needle in text, needle
    # the names are MLflow's own (mlflow.environment_variables)
    environment_variables = pytest.importorskip("mlflow.environment_variables")
    for name in (
        "MLFLOW_TRACKING_SERVER_CERT_PATH",
        "MLFLOW_TRACKING_INSECURE_TLS",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
    ):
        assert hasattr(environment_variables, name), name


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
