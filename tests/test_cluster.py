"""Running studies on a Ray cluster: `studies.cluster.submit` and the files in `cluster/`.

Fast tests: what is shipped (exclude patterns checked against Ray's own matcher), the
entrypoint, the token lookup, the argument checks, the CLI wiring, and the cluster files:
the launcher YAML validated against the schema Ray ships (ray/autoscaler/ray-schema.json),
the KubeRay RayCluster translated by Ray's own KubeRay code into an autoscaler config and
validated against that schema, and the fields of every manifest checked against the
KubeRay CRD fields (no CRD schema ships with the ray wheel; see `_check_ray_cluster_spec`).

Slow tests (real services, see tests/fixtures_cluster.py): a two-node Ray cluster on this
machine with token authentication, an MLflow server with basic auth on PostgreSQL; a
submitted study of 2 configs x 2 seeds runs to completion with trials on both nodes and
its runs in MLflow; the token and the MLflow password appear nowhere in the job's info,
log, runtime environment or MLflow; stopping the worker node mid-study makes its trials
restart (from their checkpoints) on the head, and the study completes.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import time
from pathlib import Path

import pytest
import yaml

from studies.cluster import submit as sub

try:  # the fixtures live in their own module (tests/conftest.py is shared)
    from tests import plugin_dists
    from tests.fixtures_cluster import (
        REPO_ROOT,
        mlflow_pg_server,
        postgres_server,
        ray_cluster,
    )
except ImportError:  # tests/ is not a package: pytest puts tests/ itself on sys.path
    import plugin_dists
    from fixtures_cluster import (  # noqa: F401
        REPO_ROOT,
        mlflow_pg_server,
        postgres_server,
        ray_cluster,
    )

CLUSTER = REPO_ROOT / "cluster"


def _study_text(name: str, epochs: int, train_size: int, batch_size: int, loss: str = "{name: ce}") -> str:
    return f"""\
name: {name}
description: 2 configs x 2 seeds on synthetic features (cluster test)
base:
  data: {{name: synthetic, num_classes: 10, num_superclasses: 2, train_size: {train_size},
         val_size: 100, test_size: 100, form: features, feature_dim: 16}}
  model: {{name: mlp, hidden_dim: 16}}
  loss: {loss}
  optim: {{lr: 0.1, batch_size: {batch_size}, milestones: []}}
  epochs: {epochs}
  eval: {{ks: [1, 5], selection: val/top5}}
  device: cpu
design:
  - kind: grid
    parameters: {{optim.lr: [0.05, 0.1]}}
seeds: [0, 1]
resources: {{cpus: 1, gpus: 0}}
max_failures: 3
checkpoint_interval_s: 0   # every epoch: the worker node dies after some, before the end
"""


def _write_study(
    folder: Path, name: str, epochs: int = 2, train_size: int = 300, batch_size: int = 64, loss: str = "{name: ce}"
) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(_study_text(name, epochs, train_size, batch_size, loss))
    return path


# ============================================================================ fast tests


PATHS = [
    "studies_out/quickstart/mlflow.db",
    "a/studies_out/x",
    ".git/config",
    ".git/objects/ab/cd",
    "benchmarks/out/result.json",
    "benchmarks/outside.py",
    "benchmarks/run.py",
    "x.db",
    "sub/y.db",
    "studies/__pycache__/spec.cpython-311.pyc",
    "pkg.egg-info/PKG-INFO",
    "studies/spec.py",
    "setvalued/losses/topk.py",
    "cluster/README.md",
    "mlruns/0/meta.yaml",
    "docs/out/x.md",
    "build/lib/a.py",
    "tests/build_helpers.py",
    "dist/x.whl",
]


def test_exclude_matcher_agrees_with_rays_matcher():
    """Our gitignore-style matcher decides like the one Ray uses for `excludes`."""
    from ray._private.thirdparty.pathspec import PathSpec

    patterns = list(sub.DEFAULT_EXCLUDES) + ["/docs/out/", "**/*.tmp", "notes?.txt"]
    ours = sub.exclude_matcher(patterns)
    rays = PathSpec.from_lines("gitwildmatch", patterns)
    paths = PATHS + ["a/b/c.tmp", "notes1.txt", "notes12.txt", "x/docs/out/y"]
    decisions = {p: ours(p, False) for p in paths}
    assert decisions == {p: rays.match_file(p) for p in paths}
    # and the decisions are the ones the shipping rules want
    assert decisions["studies_out/quickstart/mlflow.db"] and decisions[".git/config"]
    assert decisions["benchmarks/out/result.json"] and not decisions["benchmarks/outside.py"]
    assert not decisions["studies/spec.py"] and not decisions["tests/build_helpers.py"]


def test_stage_working_dir_ships_the_project_and_the_study(tmp_path):
    project = tmp_path / "project"
    for rel in [
        "studies/spec.py",
        "setvalued/training/trial.py",
        "studies_out/q/mlflow.db",
        ".git/HEAD",
        "benchmarks/out/r.json",
        "benchmarks/bench.py",
        "notes/private.txt",
        "cluster/README.md",
        "cluster/mlflow/.env",
        "cluster/mlflow/start.sh",
        "cluster/secrets/key.pem",
        "mlflow/.env.keep",
    ]:
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(rel)
    (project / ".gitignore").write_text("notes/\n")
    # a nested .gitignore applies below its own folder only (mlflow/.env.keep stays)
    (project / "cluster" / ".gitignore").write_text("mlflow/.env\nsecrets/\n")
    study = _write_study(tmp_path, "staged")
    staging = tmp_path / "staging"
    staging.mkdir()
    rel = sub.stage_working_dir(study, project, staging)
    assert rel == "_submitted/staged.yaml"
    assert (staging / rel).read_text() == study.read_text()
    shipped = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
    assert shipped == [
        "_submitted/staged.yaml",
        "benchmarks/bench.py",
        "cluster/README.md",
        "cluster/mlflow/start.sh",
        "mlflow/.env.keep",
        "setvalued/training/trial.py",
        "studies/spec.py",
    ]
    # installed project (no source tree): only the study file travels
    only = tmp_path / "only"
    only.mkdir()
    sub.stage_working_dir(study, None, only)
    assert [p.name for p in only.rglob("*") if p.is_file()] == ["staged.yaml"]


def test_find_project_dir_is_this_checkout():
    assert sub.find_project_dir() == REPO_ROOT


def test_entrypoint_runs_the_study_on_the_cluster():
    entry = sub.build_entrypoint(
        "_submitted/my study.yaml", "http://mlflow:5000", "s3://bucket/studies", None, ["--smoke"]
    )
    assert entry == (
        "python -m studies.cli run '_submitted/my study.yaml' --address auto "
        "--tracking-uri http://mlflow:5000 --storage s3://bucket/studies "
        "--no-report --smoke"
    )


def test_token_lookup_order(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert sub.resolve_ray_token() is None
    (home / ".ray" / "auth_token").write_text("from-home-file\n")
    assert sub.resolve_ray_token().value == "from-home-file"
    named = tmp_path / "named"
    named.write_text("from-named-file")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(named))
    assert sub.resolve_ray_token().value == "from-named-file"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    token = sub.resolve_ray_token()
    assert token.value == "from-env" and "from-env" not in repr(token) + str(token)
    explicit = tmp_path / "explicit"
    explicit.write_text("  from-explicit \n")
    assert sub.resolve_ray_token(explicit).value == "from-explicit"
    assert token.header() == {"Authorization": "Bearer from-env"}
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(sub.SubmitError, match="is empty"):
        sub.resolve_ray_token(tmp_path / "empty")
    with pytest.raises(sub.SubmitError, match="cannot read the Ray token file"):
        sub.resolve_ray_token(tmp_path / "missing")


def test_mask_secrets():
    assert sub.mask_secrets("a s3cr3t-token b s3cr3t-token", ["s3cr3t-token", None, ""]) == "a *** b ***"


@pytest.mark.parametrize(
    "uri, message",
    [
        (None, "--tracking-uri is required"),
        ("sqlite:///tmp/mlflow.db", "workers on several nodes need an MLflow server"),
        ("/shared/mlruns", "workers on several nodes need an MLflow server"),
        ("http://user:pw@mlflow:5000", "has credentials in it"),
    ],
)
def test_tracking_uri_checks(uri, message, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(sub.SubmitError, match=re.escape(message)) as error:
        sub.check_tracking_uri(uri)
    assert "pw@" not in str(error.value)


def test_tracking_uri_from_environment(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.org")
    assert sub.check_tracking_uri(None) == "https://mlflow.example.org"


@pytest.mark.parametrize(
    "storage, message",
    [
        (None, "--storage is required"),
        ("", "--storage is required"),
        ("shared/studies", "must be absolute"),
        ("ftp://host/x", "unknown scheme 'ftp'"),
    ],
)
def test_storage_checks(storage, message):
    with pytest.raises(sub.SubmitError, match=re.escape(message)):
        sub.check_storage(storage)
    assert sub.check_storage("s3://bucket/x") == "s3://bucket/x"
    assert sub.check_storage("/mnt/shared") == "/mnt/shared"


def test_address_normalisation(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert sub.normalize_address(None) == "http://127.0.0.1:8265"
    assert sub.normalize_address("head:8265") == "http://head:8265"
    monkeypatch.setenv("RAY_ADDRESS", "http://from-env:8265")
    assert sub.normalize_address(None) == "http://from-env:8265"
    assert sub.normalize_address("https://head:443/") == "https://head:443"
    for bad in ("auto", "gcs://x", " "):
        with pytest.raises(sub.SubmitError):
            sub.normalize_address(bad)


def test_submit_refuses_bad_input_before_contacting_a_cluster(tmp_path):
    # nothing listens on port 9: a check that passed would fail with "cannot reach"
    study = _write_study(tmp_path, "bad_input")
    with pytest.raises(sub.SubmitError, match="does not exist"):
        sub.submit_study(tmp_path / "missing.yaml", "http://127.0.0.1:9", "http://127.0.0.1:5000", "/shared")
    with pytest.raises(sub.SubmitError, match="must be absolute"):
        sub.submit_study(study, "http://127.0.0.1:9", "http://127.0.0.1:5000", "rel/x")
    bad = tmp_path / "bad.yaml"
    bad.write_text(study.read_text().replace("seeds: [0, 1]", "seeds: zero"))
    from studies.studyfile.spec import StudyError

    with pytest.raises(StudyError, match="seeds"):
        sub.submit_study(bad, "http://127.0.0.1:9", "http://127.0.0.1:5000", "/shared")
    with pytest.raises(sub.SubmitError, match="cannot reach the Ray Jobs API"):
        sub.submit_study(study, "http://127.0.0.1:9", "http://127.0.0.1:5000", "/shared")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="studies")
    sub.add_subcommands(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize(
    "flags, passed",
    [
        ([], []),
        (["--smoke"], ["--smoke"]),
        (["--smoke-epochs", "2"], ["--smoke", "--smoke-epochs", "2"]),
        (
            ["--smoke", "--smoke-epochs", "3", "--run-args=--progress-every 5"],
            ["--smoke", "--smoke-epochs", "3", "--progress-every", "5"],
        ),
    ],
)
def test_submit_passes_the_smoke_flags_to_studies_run(flags, passed, monkeypatch, capsys):
    sent = {}
    monkeypatch.setattr(sub, "submit_study", lambda *a, **k: sent.update(k) or "job-1")
    args = _parser().parse_args(
        [
            "submit",
            "s.yaml",
            "--address",
            "http://h:8265",
            "--tracking-uri",
            "http://m:5000",
            "--storage",
            "/nfs/x",
            *flags,
        ]
    )
    assert args.handler(args) == 0
    assert sent["extra_args"] == passed


def test_ctrl_c_while_following_a_submission_names_the_job_left_running(monkeypatch, capsys):
    monkeypatch.setattr(sub, "submit_study", lambda *a, **k: "job-7")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sub, "job_logs", interrupted)
    args = _parser().parse_args(["submit", "s.yaml", "--address", "http://h:8265", "--follow"])
    assert args.handler(args) == 130
    assert "job job-7 keeps running on the cluster (`studies stop job-7` ends it)" in capsys.readouterr().err


def test_submit_refuses_a_smoke_of_no_epochs(monkeypatch, capsys):
    monkeypatch.setattr(sub, "submit_study", lambda *a, **k: pytest.fail("submitted"))
    args = _parser().parse_args(["submit", "s.yaml", "--address", "http://h:8265", "--smoke-epochs", "0"])
    assert args.handler(args) == 2
    assert "--smoke-epochs: expected a whole number of epochs of at least 1, got 0" in capsys.readouterr().err


def test_subcommands_parse():
    parser = _parser()
    args = parser.parse_args(
        [
            "submit",
            "s.yaml",
            "--address",
            "http://h:8265",
            "--tracking-uri",
            "http://m:5000",
            "--storage",
            "/nfs/x",
            "--follow",
            "--run-args=--progress-every 5",
        ]
    )
    assert (args.file, args.address, args.storage, args.follow) == ("s.yaml", "http://h:8265", "/nfs/x", True)
    assert args.run_args == "--progress-every 5" and callable(args.handler)
    args = parser.parse_args(["logs", "studies-x-1", "-f", "--token-file", "/t"])
    assert (args.job_id, args.follow, args.token_file) == ("studies-x-1", True, "/t")
    for argv in (["jobs"], ["stop", "job1"]):
        assert callable(parser.parse_args(argv).handler)


def test_cli_reports_bad_input_in_one_paragraph(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    study = _write_study(tmp_path, "cli_bad")
    args = _parser().parse_args(["submit", str(study), "--address", "http://127.0.0.1:9", "--storage", "/nfs"])
    assert args.handler(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("studies: error: --tracking-uri is required") and "Traceback" not in err


# ---------------------------------------------------------------------------- cluster files


def _load_yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _launcher_files() -> list[Path]:
    return sorted((CLUSTER / "launcher").glob("*.yaml"))


def test_launcher_config_validates_against_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    files = _launcher_files()
    assert files, "cluster/launcher/ has no cluster config"
    for path in files:
        config = yaml.safe_load(path.read_text())
        validate_config(prepare_config(config))
        # GPU workers, a head without GPUs, token auth and the MLflow credentials
        types = config["available_node_types"]
        head = types[config["head_node_type"]]
        workers = [t for name, t in types.items() if name != config["head_node_type"]]
        assert head["resources"].get("GPU", 0) == 0
        assert any(t["resources"].get("GPU", 0) >= 1 and t["max_workers"] >= 1 for t in workers)
        start = " ".join(config["head_start_ray_commands"] + config["worker_start_ray_commands"])
        assert "RAY_AUTH_MODE=token" in start and "RAY_AUTH_TOKEN_PATH" in start
        assert "--dashboard-host" in start
        mounts = config["file_mounts"]
        assert any(remote.endswith("/.ray/auth_token") for remote in mounts)
        assert any(remote.endswith("/.mlflow/credentials") for remote in mounts)
        text = path.read_text()
        assert not re.search(r"(?i)(password|secret|token)\s*[:=]\s*['\"]?[A-Za-z0-9]{12,}", text), (
            f"{path}: looks like a secret is written in the file"
        )


def test_launcher_schema_check_is_real():
    """A launcher config with a misspelt field fails Ray's schema (the check can fail)."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(_launcher_files()[0].read_text())
    worker = next(name for name in config["available_node_types"] if name != config["head_node_type"])
    config["available_node_types"][worker]["max_worker"] = 2  # misspelt
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(config))


# KubeRay CRD fields (ray.io/v1), from the KubeRay API reference (docs.ray.io "KubeRay API
# reference", ray-operator/apis/ray/v1/raycluster_types.go and rayjob_types.go). The ray
# wheel ships no CRD schema, so these checks stand in for `kubectl apply --dry-run=server`.
RAYCLUSTER_SPEC_FIELDS = {
    "rayVersion",
    "enableInTreeAutoscaling",
    "autoscalerOptions",
    "headGroupSpec",
    "workerGroupSpecs",
    "headServiceAnnotations",
    "suspend",
    "managedBy",
    "gcsFaultToleranceOptions",
    "authOptions",
}
HEAD_GROUP_FIELDS = {
    "rayStartParams",
    "template",
    "serviceType",
    "headService",
    "enableIngress",
    "replicas",
    "resources",
    "labels",
}
WORKER_GROUP_FIELDS = {
    "groupName",
    "replicas",
    "minReplicas",
    "maxReplicas",
    "rayStartParams",
    "template",
    "scaleStrategy",
    "numOfHosts",
    "idleTimeoutSeconds",
    "suspend",
    "resources",
    "labels",
}
RAYJOB_SPEC_FIELDS = {
    "entrypoint",
    "runtimeEnvYAML",
    "metadata",
    "jobId",
    "shutdownAfterJobFinishes",
    "ttlSecondsAfterFinished",
    "activeDeadlineSeconds",
    "rayClusterSpec",
    "clusterSelector",
    "submissionMode",
    "submitterPodTemplate",
    "submitterConfig",
    "entrypointNumCpus",
    "entrypointNumGpus",
    "entrypointResources",
    "suspend",
    "managedBy",
    "backoffLimit",
    "deletionStrategy",
    "rayClusterSpecOverride",
}


def _check_pod_template(template: dict, where: str) -> dict:
    assert set(template) <= {"metadata", "spec"}, where
    containers = template["spec"]["containers"]
    assert containers and all({"name", "image"} <= set(c) for c in containers), where
    ray = containers[0]  # KubeRay: the Ray container is the first one
    for var in ray.get("env", []):
        assert set(var) <= {"name", "value", "valueFrom"}, f"{where}: env {var}"
        if re.search(r"PASSWORD|TOKEN|SECRET", var["name"]):
            assert "valueFrom" in var and "value" not in var, (
                f"{where}: {var['name']} must come from a Secret, not a literal"
            )
    return ray


def _check_ray_cluster_spec(spec: dict, where: str) -> None:
    assert set(spec) <= RAYCLUSTER_SPEC_FIELDS, f"{where}: {set(spec) - RAYCLUSTER_SPEC_FIELDS}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", spec["rayVersion"]), where
    head = spec["headGroupSpec"]
    assert set(head) <= HEAD_GROUP_FIELDS, where
    assert all(isinstance(v, str) for v in head["rayStartParams"].values()), (
        f"{where}: rayStartParams values must be strings"
    )
    ray = _check_pod_template(head["template"], f"{where}.headGroupSpec")
    ports = {p["name"]: p["containerPort"] for p in ray.get("ports", [])}
    assert ports.get("dashboard") == 8265 and ports.get("gcs-server") == 6379, where
    names = set()
    for group in spec["workerGroupSpecs"]:
        assert set(group) <= WORKER_GROUP_FIELDS, f"{where}: {set(group) - WORKER_GROUP_FIELDS}"
        assert group["groupName"] not in names
        names.add(group["groupName"])
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], where
        assert all(isinstance(v, str) for v in group["rayStartParams"].values()), where
        ray = _check_pod_template(group["template"], f"{where}.{group['groupName']}")
        limits = ray["resources"]["limits"]
        assert str(limits.get("nvidia.com/gpu", "0")) != "0", (
            f"{where}: worker group {group['groupName']} has no GPU limit"
        )


def _kube_docs() -> dict[str, list[dict]]:
    docs: dict[str, list[dict]] = {}
    for path in sorted((CLUSTER / "kuberay").glob("*.yaml")):
        for doc in _load_yaml_documents(path):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{path}: {doc.keys()}"
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", doc["metadata"]["name"])
            docs.setdefault(doc["kind"], []).append(doc)
    return docs


def test_kuberay_raycluster_validates_with_rays_kuberay_translation():
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    docs = _kube_docs()
    clusters = docs.get("RayCluster", [])
    assert clusters, "cluster/kuberay/ has no RayCluster"
    for cluster in clusters:
        assert cluster["apiVersion"] == "ray.io/v1"
        _check_ray_cluster_spec(cluster["spec"], f"RayCluster {cluster['metadata']['name']}")
        cr = dict(cluster, metadata=dict(cluster["metadata"]))
        cr["metadata"].setdefault("namespace", "default")
        autoscaling = _derive_autoscaling_config_from_ray_cr(cr)  # validates ray-schema.json
        gpu_types = [t for t in autoscaling["available_node_types"].values() if t["resources"].get("GPU", 0) >= 1]
        assert gpu_types, "no worker group gives Ray a GPU"
        assert autoscaling["available_node_types"]["headgroup"]["resources"].get("GPU", 0) == 0


def test_kuberay_rayjob_runs_a_study_file():
    docs = _kube_docs()
    jobs = docs.get("RayJob", [])
    assert jobs, "cluster/kuberay/ has no RayJob"
    config_maps = {c["metadata"]["name"]: c for c in docs.get("ConfigMap", [])}
    for job in jobs:
        assert job["apiVersion"] == "ray.io/v1"
        spec = job["spec"]
        assert set(spec) <= RAYJOB_SPEC_FIELDS, set(spec) - RAYJOB_SPEC_FIELDS
        assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
        entry = spec["entrypoint"]
        assert re.search(r"studies(\.cli)? run \S+\.yaml .*--address auto", entry)
        assert "--tracking-uri http" in entry and "--storage" in entry
        assert not re.search(r"://[^/\s]*:[^/\s]*@", entry), "credentials in the entrypoint"
        runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML", "{}")) or {}
        assert "RAY_AUTH_TOKEN" not in json.dumps(runtime_env)
        _check_ray_cluster_spec(spec["rayClusterSpec"], f"RayJob {job['metadata']['name']}")
        # the study file comes from a ConfigMap mounted into the head pod
        head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
        study_path = re.search(r"run (\S+\.yaml)", entry).group(1)
        mounts = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
        volume = next(v for v in head["volumes"] if v["name"] == mounts[str(Path(study_path).parent)])
        config_map = config_maps[volume["configMap"]["name"]]
        study_name = Path(study_path).name
        from studies.studyfile.spec import parse_study  # the mounted study file is a valid study

        assert study_name in config_map["data"]
        assert parse_study(config_map["data"][study_name], file=study_name).name


def test_mlflow_deployment_files():
    compose = yaml.safe_load((CLUSTER / "mlflow" / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "mlflow"} <= set(services)
    mlflow = services["mlflow"]
    command = json.dumps(mlflow.get("command", "")) + json.dumps(mlflow.get("entrypoint", ""))
    assert "start-mlflow-server.sh" in command
    env = mlflow["environment"]
    env = env if isinstance(env, dict) else dict(e.split("=", 1) for e in env)
    for key, value in env.items():  # secrets come from the .env file, never literals
        if re.search(r"PASSWORD|SECRET|KEY", key):
            assert re.fullmatch(r"\$\{[A-Z0-9_]+(:?\?[^}]*)?\}", str(value)), (key, value)
    docs = _kube_docs()
    deployments = {d["metadata"]["name"]: d for d in docs.get("Deployment", [])}
    assert "mlflow" in deployments
    container = deployments["mlflow"]["spec"]["template"]["spec"]["containers"][0]
    _check_pod_template(deployments["mlflow"]["spec"]["template"], "Deployment mlflow")
    assert any(p["containerPort"] == 5000 for p in container["ports"])
    script = (CLUSTER / "mlflow" / "start-mlflow-server.sh").read_text()
    assert "--app-name basic-auth" in script and "postgresql+psycopg2://" in script


def test_readme_walks_from_nothing_to_a_running_study():
    text = (CLUSTER / "README.md").read_text()
    for needle in (
        "docker build",
        "ray up",
        "kubectl apply",
        "studies submit",
        "studies logs",
        "RAY_AUTH_TOKEN",
        "MLFLOW_TRACKING_USERNAME",
        "--storage",
        "start-mlflow-server.sh",
    ):
        assert needle in text, needle
    # every file the README names exists
    for rel in re.findall(r"cluster/[\w./-]+\.(?:yaml|sh|md|sql|ini)|cluster/Dockerfile", text):
        assert (REPO_ROOT / rel).exists(), rel


# ============================================================================ slow tests


def _trial_actors(cluster) -> list[dict]:
    """Actors that ran Tune trials (the function trainable's class)."""
    return [a for a in cluster.actors() if a.get("class_name") == "ImplicitFunc"]


def _cell_runs(mlflow_server, study_name: str) -> list:
    client = mlflow_server.client()
    experiment = client.get_experiment_by_name(study_name)
    assert experiment is not None, f"no MLflow experiment {study_name}"
    return client.search_runs(
        [experiment.experiment_id], filter_string="tags.`studies.role` = 'cell'", max_results=1000
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_token_is_required_and_checked(ray_cluster, tmp_path, monkeypatch):
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    with pytest.raises(sub.SubmitError, match="requires a token and none was found"):
        sub.list_jobs(ray_cluster.dashboard_url)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-token")
    with pytest.raises(sub.SubmitError, match="rejected the token from environment") as error:
        sub.list_jobs(ray_cluster.dashboard_url)
    assert "not-the-token" not in str(error.value)
    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_cluster.token)
    jobs_before = len(sub.list_jobs(ray_cluster.dashboard_url))
    # a job whose arguments would carry the token is refused before it is sent
    study = _write_study(tmp_path, "leaky")
    with pytest.raises(sub.SubmitError, match="refusing to submit") as error:
        sub.submit_study(
            study,
            ray_cluster.dashboard_url,
            "http://127.0.0.1:5000",
            "/tmp/shared",
            extra_args=["--note", ray_cluster.token],
        )
    assert ray_cluster.token not in str(error.value)
    assert len(sub.list_jobs(ray_cluster.dashboard_url)) == jobs_before


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stop_job(ray_cluster, capsys, tmp_path):
    """`studies stop`: SIGTERM to the driver, which gets the grace of a submitted study's job
    environment (issue 33: Ray's default 3 s would SIGKILL a driver closing its runs) before
    SIGKILL: this driver takes 5 s to close after SIGTERM."""
    client, _ = sub.job_client(ray_cluster.dashboard_url, ray_cluster.token_file)
    closed = tmp_path / "closed"
    driver = (
        "import pathlib, signal, sys, time\n"
        "def close(*_):\n"
        "    time.sleep(5)\n"
        f"    pathlib.Path({str(closed)!r}).write_text('runs closed')\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, close)\n"
        "time.sleep(120)\n"
    )
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "driver.py").write_text(driver)
    job_id = client.submit_job(entrypoint="python driver.py", runtime_env=sub.job_runtime_env(tmp_path / "job"))
    deadline = time.monotonic() + 60
    while sub.job_status(ray_cluster.dashboard_url, job_id, token_file=ray_cluster.token_file) != "RUNNING":
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.5)
    args = _parser().parse_args(
        ["stop", job_id, "--address", ray_cluster.dashboard_url, "--token-file", str(ray_cluster.token_file)]
    )
    assert args.handler(args) == 0
    assert capsys.readouterr().out.strip() == f"job {job_id}: STOPPED"
    assert sub.job_status(ray_cluster.dashboard_url, job_id, token_file=ray_cluster.token_file) == "STOPPED"
    assert closed.read_text() == "runs closed"  # not killed before it had closed
    assert not sub.stop_job(
        ray_cluster.dashboard_url, job_id, token_file=ray_cluster.token_file
    )  # not running any more


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_submitted_study_runs_on_both_nodes(ray_cluster, mlflow_pg_server, tmp_path, capsys, monkeypatch):
    """The study's loss is the example plugin's, registered on this (submitting) machine only:
    `studies submit` ships it with the job, so both nodes train with it (issue #32)."""
    from setvalued import registry

    site = plugin_dists.write_example(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))  # not on PYTHONPATH: the cluster's nodes never see it
    registry.clear_cache()
    ray_cluster.ensure_worker()
    name = f"cluster_e2e_{int(time.time())}"
    study = _write_study(tmp_path, name, epochs=2, loss="{name: ls_topk_hinge, k: 3}")
    storage = ray_cluster.root / "shared"  # one machine: a local folder is shared
    cluster_args = ["--address", ray_cluster.dashboard_url, "--token-file", str(ray_cluster.token_file)]
    parser = _parser()  # `studies submit|jobs|logs` as the CLI runs them
    args = parser.parse_args(
        [
            "submit",
            str(study),
            "--tracking-uri",
            mlflow_pg_server.uri,
            "--storage",
            str(storage),
            "--follow",
            *cluster_args,
        ]
    )
    started = time.monotonic()
    exit_code = args.handler(args)
    elapsed = time.monotonic() - started
    captured = capsys.readouterr()
    job_id = captured.out.splitlines()[0]
    assert exit_code == 0, captured.out[-4000:] + captured.err[-2000:]
    assert job_id.startswith(f"studies-{name}-")
    assert "summary: 4/4 cells finished" in captured.out  # the streamed driver log
    assert sub.job_status(ray_cluster.dashboard_url, job_id, token_file=ray_cluster.token_file) == "SUCCEEDED"
    print(f"[cluster] study of 4 cells: {elapsed:.1f} s from submit to end")

    # the runs are in the PostgreSQL-backed MLflow server
    runs = _cell_runs(mlflow_pg_server, name)
    assert len(runs) == 4
    assert {r.data.tags["studies.status"] for r in runs} == {"finished"}
    assert len({(r.data.tags["studies.config_id"], r.data.tags["studies.seed"]) for r in runs}) == 4
    assert all("test/top5" in r.data.metrics for r in runs)
    assert sorted(float(r.data.params["optim.lr"]) for r in runs) == [0.05, 0.05, 0.1, 0.1]
    assert {r.data.params["loss.name"] for r in runs} == {"ls_topk_hinge"}
    assert {r.data.tags["studies.plugins"] for r in runs} == {"setvalued-example-plugin==0.1.0"}
    connection = mlflow_pg_server.connect_db()
    try:
        with connection.cursor() as cursor:  # the rows are in PostgreSQL itself
            cursor.execute(
                "SELECT count(*) FROM runs r JOIN experiments e ON r.experiment_id = e.experiment_id WHERE e.name = %s",
                (name,),
            )
            assert cursor.fetchone()[0] == 5  # the parent run and 4 cell runs
    finally:
        connection.close()
    # the artifacts went through the server's proxy into its artifact store
    assert len(list(mlflow_pg_server.artifacts.rglob("per_class_test.parquet"))) >= 4

    # trials ran on both nodes
    head_id = ray_cluster.node_id_with("node_a")
    worker_id = ray_cluster.node_id_with("node_b")
    actors = _trial_actors(ray_cluster)
    print("[cluster] trial actors:", [(a["actor_id"][:8], a["node_id"][:8], a["state"]) for a in actors])
    # each cell run carries the node of its trial (studies.node_id); the actor list of
    # Ray's state API is only printed, since it may drop finished actors
    assert {head_id, worker_id} <= {r.data.tags.get("studies.node_id") for r in runs}

    # the job is listed with its study, its log readable, and no secret is anywhere
    args = parser.parse_args(["jobs", *cluster_args])
    assert args.handler(args) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if job_id in line)
    assert row.split()[1:3] == ["SUCCEEDED", name]
    args = parser.parse_args(["logs", job_id, *cluster_args])
    assert args.handler(args) == 0
    assert "summary: 4/4 cells finished" in capsys.readouterr().out
    _assert_no_secrets(ray_cluster, mlflow_pg_server, job_id, name)


def _assert_no_secrets(cluster, mlflow_server, job_id: str, study_name: str) -> None:
    client, _ = sub.job_client(cluster.dashboard_url, cluster.token_file)
    info = client.get_job_info(job_id)
    raw_logs = client.get_job_logs(job_id)
    status, raw_info = cluster.get(f"/api/jobs/{job_id}")
    assert status == 200
    texts = {
        "job info": json.dumps(raw_info),
        "job details": repr(info),
        "runtime env": json.dumps(info.runtime_env),
        "entrypoint": info.entrypoint,
        "metadata": json.dumps(info.metadata),
        "job log": raw_logs,
    }
    ml = mlflow_server.client()
    experiment = ml.get_experiment_by_name(study_name)
    for run in ml.search_runs([experiment.experiment_id], max_results=1000):
        texts[f"MLflow run {run.info.run_id}"] = json.dumps([run.data.params, run.data.tags, sorted(run.data.metrics)])
    secrets_ = {
        "Ray token": cluster.token,
        "MLflow password": mlflow_server.password,
        "MLflow admin password": mlflow_server.admin_password,
    }
    for label, text in texts.items():
        for secret_label, secret in secrets_.items():
            assert secret not in text, f"the {secret_label} appears in the {label}"
    assert "RAY_AUTH_TOKEN" not in json.dumps(info.runtime_env)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_worker_node_loss_retries_its_trials_on_the_head(ray_cluster, mlflow_pg_server, tmp_path):
    ray_cluster.ensure_worker()
    head_id = ray_cluster.node_id_with("node_a")
    worker_id = ray_cluster.node_id_with("node_b")
    name = f"cluster_failover_{int(time.time())}"
    # many short epochs (250 steps each): a wide window in which the worker's trials have
    # checkpointed but not finished, so the crash always lands mid-way
    study = _write_study(tmp_path, name, epochs=24, train_size=1000, batch_size=4)
    address, token_file = ray_cluster.dashboard_url, ray_cluster.token_file
    started = time.monotonic()
    job_id = sub.submit_study(
        study, address, mlflow_pg_server.uri, str(ray_cluster.root / "shared"), token_file=token_file
    )
    ml = mlflow_pg_server.client()

    def logs() -> str:
        out = io.StringIO()
        sub.job_logs(address, job_id, token_file=token_file, stream=out)
        return out.getvalue()[-4000:]

    def epochs_logged(run) -> int:
        return len(ml.get_metric_history(run.info.run_id, "epoch_time_s"))

    # wait until a cell training on the worker (its MLflow tag studies.node_id, set by
    # every attempt) has checkpointed an epoch and not finished; MLflow, not Ray's state
    # API, says where each trial runs, since the state API may lag or drop actors
    deadline = time.monotonic() + 600
    while True:
        status = sub.job_status(address, job_id, token_file=token_file)
        assert status not in sub.TERMINAL_STATUSES, f"job ended early ({status}):\n{logs()}"
        runs = _cell_runs(mlflow_pg_server, name) if ml.get_experiment_by_name(name) else []
        on_worker = [
            r
            for r in runs
            if r.data.tags.get("studies.node_id") == worker_id
            and r.data.tags.get("studies.status") != "finished"
            and epochs_logged(r) >= 1
        ]
        if on_worker:
            break
        finished = [r for r in runs if r.data.tags.get("studies.status") == "finished"]
        assert len(finished) < 4, f"every cell finished before one ran on the worker:\n{logs()}"
        assert time.monotonic() < deadline, f"trials never got going:\n{logs()}"
        time.sleep(0.5)
    crashed_runs = {r.info.run_id for r in on_worker}
    on_head_before = {r.info.run_id for r in runs if r.data.tags.get("studies.node_id") == head_id}
    print(
        f"[cluster] {time.monotonic() - started:.1f} s: "
        f"epochs done per cell {[epochs_logged(r) for r in runs]}, "
        f"{len(on_worker)} unfinished cell(s) on the worker; crashing the worker node"
    )
    ray_cluster.stop_node(ray_cluster.worker, crash=True)
    killed_at = time.monotonic()

    status = sub.wait_for_job(address, job_id, timeout_s=600, token_file=token_file)
    print(
        f"[cluster] job {status} {time.monotonic() - killed_at:.1f} s after the crash "
        f"({time.monotonic() - started:.1f} s in all)"
    )
    assert status == "SUCCEEDED", logs()
    assert "summary: 4/4 cells finished" in logs()

    runs = _cell_runs(mlflow_pg_server, name)
    assert len(runs) == 4 and {r.data.tags["studies.status"] for r in runs} == {"finished"}
    assert all(epochs_logged(r) == 24 for r in runs)
    # the cells of the lost node restarted from their checkpoints, on the only node left:
    # a cell that was mid-way on the worker finished on the head, resumed, not from scratch
    resumed = {r.info.run_id for r in runs if "studies.resumed_from_epoch" in r.data.tags}
    assert resumed and not resumed & on_head_before, [r.data.tags for r in runs]
    for run in runs:
        if run.info.run_id in crashed_runs:
            assert run.data.tags["studies.node_id"] == head_id, run.data.tags
            assert run.info.run_id in resumed, run.data.tags
            assert int(run.data.tags["studies.resumed_from_epoch"]) >= 1, run.data.tags
    nodes = {n["node_id"]: n["state"] for n in ray_cluster.nodes()}
    assert nodes[worker_id] == "DEAD" and nodes[head_id] == "ALIVE"
    _assert_no_secrets(ray_cluster, mlflow_pg_server, job_id, name)
