"""A real ``fastinfer serve`` process for tests: a free loopback port, /health awaited with a deadline,
the whole process group killed at the end (SIGTERM, then SIGKILL). ``server`` / ``client``: module
fixtures of the default server and the pinned ``openai`` client on it (import them to use them)."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

import fastinfer

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(fastinfer.__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, startup_timeout: float = 180.0):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="fastinfer-serve-", suffix=".log", delete=False)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([PKG_ROOT, os.environ.get("PYTHONPATH", "")]))
        # float32 unless a test says otherwise: the CPU's dtype "auto" depends on the CPU, and the
        # in-process engines the tests compare with run float32 (conftest.cpu_auto_dtype_is_float32)
        dtype = [] if "--dtype" in args else ["--dtype", "float32"]
        cmd = [sys.executable, "-m", "fastinfer.entrypoints.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", *dtype, *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fastinfer serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if self.request("GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fastinfer serve not healthy after {startup_timeout} s:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def request(self, method: str, path: str, body: Any = None, headers: Optional[Dict[str, str]] = None,
                timeout: float = 60) -> Tuple[int, Dict[str, str], bytes]:
        """One raw HTTP request; ``body``: bytes as they are, anything else as JSON."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def metrics(self) -> Dict[str, float]:
        """``/metrics`` as {series name with labels stripped: value} (summed over label sets)."""
        status, _, text = self.request("GET", "/metrics")
        assert status == 200
        out: Dict[str, float] = {}
        for line in text.decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            name = re.sub(r"\{.*\}", "", name)
            out[name] = out.get(name, 0.0) + float(value)
        return out

    def wait_idle(self, timeout: float = 20.0) -> Dict[str, float]:
        """Metrics once nothing runs or waits and every KV block is free again (or the last seen)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["fastinfer:num_requests_running"] == 0 and m["fastinfer:num_requests_waiting"] == 0
                    and m["fastinfer:kv_cache_free_blocks"] == m["fastinfer:kv_cache_total_blocks"])
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self, timeout: float = 20.0) -> Optional[int]:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        self.log.close()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)
        return self.proc.returncode


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The default server (the shipped tiny model), one per test module that imports this fixture."""
    s = ServerProcess()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    """The pinned ``openai`` client on ``server``: no retries, a 60 s timeout."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse_events(raw: bytes) -> List[Any]:
    """The ``data:`` payloads of an SSE body (JSON decoded, ``[DONE]`` as the string)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
