"""Start the `tritonserver` bundled in the PyTriton wheel on a model repository (docs/architecture.md §6).

The wheel ships the server (2.51), the python backend and one backend stub per Python version, but
not the stub in the backend folder: like PyTriton, we assemble a backend directory next to the
repository with the stub of this interpreter's version. The stub embeds the *system*
``libpython3.X.so`` (Debian/Ubuntu package ``libpython3.X``), not the venv's interpreter; model.py
adds this venv's site-packages itself (the repository's config names them).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
import socket
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


READY_TIMEOUT_S = 180.0  # model load = import torch + load the engine in the stub process
STOP_TIMEOUT_S = 30.0


class ServerError(RuntimeError):
    pass


def pytriton_dir() -> Path:
    """The PyTriton package folder, found without importing it: its __init__ loads PyTriton's client
    stack (tritonclient, zmq, sh), which the bundled server and backend do not need."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("the `serve` extra is not installed: pip install -e '.[serve]' (nvidia-pytriton)")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def server_binary() -> Path:
    return pytriton_dir() / "tritonserver" / "bin" / "tritonserver"


def server_libs() -> Path:
    """The wheel's vendored shared libraries (libtritonserver, libcudart, ...)."""
    return pytriton_dir().parent / "nvidia_pytriton.libs"


def prepare_backends(dst: Path) -> Path:
    """dst/backends/python/{libtriton_python.so, triton_python_backend_utils.py, stub}; returns dst/backends."""
    dist = pytriton_dir() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"{stub}: PyTriton ships no python backend stub for Python {version}")
    backends = dst / "backends"
    if backends.exists():
        shutil.rmtree(backends)
    shutil.copytree(dist / "backends", backends, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(stub, backends / "python" / stub.name)
    (backends / "python" / stub.name).chmod(0o755)
    libpython = f"libpython{version}.so.1.0"
    probe = subprocess.run(["ldd", str(stub)], capture_output=True, text=True)
    if f"{libpython} => not found" in probe.stdout:
        raise ServerError(
            f"the python backend stub needs the system {libpython}, which is not installed: "
            f"apt-get install -y libpython{version} (the stub embeds the system interpreter, not the venv's)"
        )
    return backends


@dataclass
class TritonServer:
    """A running tritonserver process bound to ``address``; ``stop()`` (or the context) ends it."""

    repo: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    address: str = "127.0.0.1"
    log_path: Path | None = None  # None: <work_dir>/tritonserver.log
    model: str | None = None  # with launch_id: wait_ready checks that the ready server is this one
    launch_id: str | None = None  # the model config's launch_id parameter (write_model_repository)
    inherit_output: bool = False  # True: the server logs to this process's stdout/stderr (the CLI)
    extra_args: list[str] = field(default_factory=list)
    process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.address}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.address}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.address}:{self.metrics_port}/metrics"

    def command(self, backends: Path) -> list[str]:
        return [
            str(server_binary()),
            f"--model-repository={self.repo}",
            f"--backend-directory={backends}",
            f"--cache-directory={pytriton_dir() / 'tritonserver' / 'caches'}",
            f"--http-address={self.address}", f"--http-port={self.http_port}",
            f"--grpc-address={self.address}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.address}", f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            "--exit-on-error=true", "--strict-readiness=true",
            *self.extra_args,
        ]

    def check_ports(self) -> None:
        """Refuse ports another process holds, before starting anything (tritonserver would start,
        fail to bind one of them, and another server could answer our readiness probe)."""
        for what, port in (("--http-port", self.http_port), ("--grpc-port", self.grpc_port),
                           ("--metrics-port", self.metrics_port)):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are no conflict
                try:
                    s.bind((self.address, port))
                except OSError as e:
                    why = "is in use by another process" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e})"
                    raise ServerError(f"{what} {port} on {self.address} {why}; stop that process or choose "
                                      f"another port ({what} N)") from None

    def start(self, work_dir: Path) -> "TritonServer":
        self.check_ports()
        backends = prepare_backends(Path(work_dir))
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(server_libs()), env.get("LD_LIBRARY_PATH")) if p)
        # The stub embeds the system libpython; it finds this venv (and its numpy<2, which
        # triton_python_backend_utils imports before model.py can extend sys.path) only when the
        # venv's bin comes first on PATH, as after activation. PYTHONPATH does not reach its sys.path
        # (the stub's environment has it; its interpreter ignores it).
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        # own process group: stop() signals the server and its python-backend stubs together
        if self.inherit_output:
            self.process = subprocess.Popen(self.command(backends), env=env, start_new_session=True)
            return self
        self.log_path = self.log_path or Path(work_dir) / "tritonserver.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(backends), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise ServerError(f"tritonserver exited ({self.returncode()}) before it was ready:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200 and self._is_ours():
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise ServerError(f"tritonserver not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def _is_ours(self) -> bool:
        if self.model is None or self.launch_id is None:
            return True
        url = f"http://{self.http_url}/v2/models/{self.model}/config"
        with urllib.request.urlopen(url, timeout=2) as r:
            params = json.loads(r.read()).get("parameters", {})
        if params.get("launch_id", {}).get("string_value") != self.launch_id:
            raise ServerError(f"another tritonserver answers on {self.http_url} (its {self.model} model is not the one "
                              "this launch wrote); stop it or choose other ports")
        return True

    def backend_stubs(self) -> list[int]:
        """Pids of the python-backend stub processes of this server."""
        return [] if self.process is None else backend_stub_pids(self.process.pid)

    def supervise(self, poll_s: float = 1.0, stop_event=None) -> str:
        """Block while the server and its backend stubs live; returns why serving stopped.

        Triton 2.51 keeps answering /v2/health/ready 200 after a stub process dies, while every
        request to that model fails: this watch turns that into a stopped server and a clear error."""
        stubs = set(self.backend_stubs())
        while stop_event is None or not stop_event.is_set():
            code = self.returncode()
            if code is not None:
                return f"tritonserver exited with status {code}"
            dead = [p for p in stubs if not Path(f"/proc/{p}").exists() or _is_zombie(p)]
            if dead:
                return (f"the python backend stub process (pid {', '.join(map(str, dead))}) died: the model cannot "
                        "serve; stopping tritonserver (see its log for the cause, then start `dsa-trt serve` again)")
            stubs |= set(self.backend_stubs())
            time.sleep(poll_s)
        return "stopped"

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        p = self.process
        if p is None or p.poll() is not None:
            return
        os.killpg(p.pid, signal.SIGTERM)  # tritonserver drains, unloads models, exits
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def backend_stub_pids(server_pid: int) -> list[int]:
    """Pids of the python-backend stubs that tritonserver ``server_pid`` started (from /proc)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == server_pid and b"triton_python_backend_stub" in cmd:
            pids.append(int(d.name))
    return sorted(pids)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def free_ports(n: int, address: str = "127.0.0.1") -> list[int]:
    """n distinct ports free right now on ``address`` (bound together so none repeats)."""
    import socket

    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((address, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
