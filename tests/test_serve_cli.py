"""`tandem serve` and `tandem client` as users run them: real processes, loopback, SIGTERM shutdown."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

TANDEM = [sys.executable, "-m", "cluster.cli"]


@pytest.fixture
def server():
    proc = subprocess.Popen([*TANDEM, "serve", "--grpc-port", "0", "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        banner = ""
        for line in proc.stdout:
            banner += line
            match = re.search(r"gRPC 127\.0\.0\.1:(\d+), HTTP http://127\.0\.0\.1:(\d+)/v1", line)
            if match:
                yield proc, int(match.group(1)), int(match.group(2))
                break
        else:
            pytest.fail(f"tandem serve exited before listening:\n{banner}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def test_serve_answers_grpc_and_http_then_stops_on_sigterm(server):
    proc, grpc_port, http_port = server
    client = subprocess.run([*TANDEM, "client", "hello", "--target", f"127.0.0.1:{grpc_port}",
                             "--max-tokens", "8", "--ignore-eos"], capture_output=True, text=True, timeout=60)
    assert client.returncode == 0, client.stderr
    assert "[length] ttft" in client.stdout
    body = json.dumps({"prompt": [104, 105], "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(request, timeout=30).read())
    assert len(reply["choices"][0]["token_ids"]) == 5 and reply["choices"][0]["finish_reason"] == "length"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert "shutting down" in proc.stdout.read()


def test_serve_rejects_disaggregated_until_workers_exist():
    done = subprocess.run([*TANDEM, "serve", "--mode", "disaggregated", "--grpc-port", "0", "--http-port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "colocated" in done.stderr
