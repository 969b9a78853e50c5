"""Starts and stops a real `nanoinfer serve` process for the server tests."""

import os
import re
import signal
import subprocess
import threading
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target"))
CLI = os.path.join(TARGET, "release", "nanoinfer")
MODEL = os.environ.get("NANOINFER_TEST_MODEL", os.path.join(REPO, "models", "SmolLM2-135M-Instruct"))


class Server:
    """`nanoinfer serve --port 0 ARGS...`; the port is read from its log."""

    def __init__(self, *args, threads=2, cli=CLI, model=MODEL):
        self.args = [cli, "serve", "--model", model, "--port", "0", "--threads", str(threads), *args]
        self.proc = None
        self.base = None
        self.log = []

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self, timeout=120):
        self.proc = subprocess.Popen(self.args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        ready = threading.Event()

        def pump():
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m:
                    self.base = m.group(1)
                    ready.set()
            ready.set()

        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()
        if not ready.wait(timeout) or self.base is None:
            self.stop()
            raise RuntimeError("server did not start: " + "".join(self.log))

    @property
    def pid(self):
        return self.proc.pid

    def terminate(self):
        """SIGTERM: the graceful shutdown."""
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout):
        return self.proc.wait(timeout)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc and self.proc.stderr:
            self.pump.join(5)  # it reads to the end of the closed pipe
            self.proc.stderr.close()


def metrics(client, base):
    """`/metrics` as {name{labels}: value}."""
    out = {}
    for line in client.get(base + "/metrics").text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def wait_until(predicate, timeout, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0
