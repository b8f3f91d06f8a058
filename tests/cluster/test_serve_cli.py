"""`tandem serve` and `tandem client` as users run them: real processes, loopback, SIGTERM shutdown; the refusals
that start nothing run `tandem`'s entry point (cluster.cli.main) in this process."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
import ray

from cluster import cli
from tests.support.serve_process import TANDEM, descendants, live_processes, start_serve
from tests.support.timing_checks import assert_remote_prefill_timing


@pytest.fixture
def server():
    with start_serve() as serving:
        yield serving


def complete_over_http(http_port: int, max_tokens: int) -> dict:
    body = json.dumps({"prompt": [104, 105], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


def test_serve_answers_grpc_and_http_then_stops_on_sigterm(server):
    proc, grpc_port, http_port = server
    client = subprocess.run([*TANDEM, "client", "hello", "--target", f"127.0.0.1:{grpc_port}",
                             "--max-tokens", "8", "--ignore-eos"], capture_output=True, text=True, timeout=60)
    assert client.returncode == 0, client.stderr
    assert "[length] ttft" in client.stdout
    reply = complete_over_http(http_port, 5)
    assert len(reply["choices"][0]["token_ids"]) == 5 and reply["choices"][0]["finish_reason"] == "length"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert "shutting down" in proc.stdout.read()


def test_serve_disaggregated_streams_with_timing_and_sigterm_stops_ray_and_workers():
    # --transport auto: gloo between two CPU workers on one host (the coordinator tests cover grpc)
    with start_serve("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1") \
            as (proc, grpc_port, http_port):
        started = check_disaggregated_serving(proc, grpc_port, http_port)
    deadline = time.monotonic() + 20
    while started & set(live_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not started & set(live_processes()), "processes tandem serve started outlived it"


def check_disaggregated_serving(proc: subprocess.Popen, grpc_port: int, http_port: int) -> set[int]:
    """Warmed up before it listened (one request through a private front end: not in /metrics), serves over HTTP
    and gRPC, then stops on SIGTERM; returns the processes it had started."""
    started = descendants(proc.pid)
    assert started, "no Ray processes under tandem serve"
    assert "serving warm-up: 1 of 1 request(s) of 48 prompt tokens done" in proc.startup_log, proc.startup_log
    reply = complete_over_http(http_port, 6)
    choice = reply["choices"][0]
    assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
    timing = reply["tandem_timing"]
    assert timing["prefill_worker"] == "prefill-0" and timing["decode_worker"] == "decode-0"
    assert_remote_prefill_timing(timing)
    client = subprocess.run([*TANDEM, "client", "hello", "--target", f"127.0.0.1:{grpc_port}",
                             "--max-tokens", "4", "--ignore-eos"], capture_output=True, text=True, timeout=60)
    assert client.returncode == 0 and "[length] ttft" in client.stdout, client.stderr
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30).read().decode()
    for worker, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        assert f'tandem_worker_kv_total_blocks{{role="{role}",worker="{worker}"}}' in metrics, metrics[-2000:]
    http_requests = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith('tandem_requests_total{') and 'frontend="http"' in line]
    assert sum(http_requests) == 1, "the warm-up's request is counted in /metrics"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert "shutting down" in proc.stdout.read()
    return started


def test_serve_rejects_inconsistent_modes(capsys):
    """The CLI's own entry point (cluster.cli.main, what `tandem` runs), in this process: a refusal needs no
    interpreter of its own (~4 s of start-up each on the 2-core CI machine); the tests above run real processes."""
    with refused_before_starting_anything():
        assert cli.main(["serve", "--mode", "colocated", "--prefill-workers", "2", "--grpc-port", "0",
                         "--http-port", "0"]) == 2
    assert "disaggregated" in capsys.readouterr().err


def test_both_worker_counts_without_a_mode_mean_disaggregated():
    """The CLI contract: `--prefill-workers P --decode-workers D` with no --mode is disaggregated serving;
    no worker counts is the colocated engine."""
    import argparse

    from cluster.serve import add_arguments, config_from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    both = config_from_args(parser.parse_args(["--prefill-workers", "1", "--decode-workers", "2"]))
    assert (both.mode, both.prefill_workers, both.decode_workers) == ("disaggregated", 1, 2)
    assert config_from_args(parser.parse_args([])).mode == "colocated"
    assert config_from_args(parser.parse_args(["--mode", "disaggregated"])).prefill_workers == 1


def test_engine_flags_reach_the_engine_config():
    import argparse

    from cluster.serve import add_arguments, config_from_args
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine = config_from_args(parser.parse_args(["--attention-backend", "torch", "--enforce-eager",
                                                 "--gpu-memory-utilization", "0.5",
                                                 "--mixed-graph-max-tokens", "512"])).engine
    assert (engine.attention_backend, engine.enforce_eager, engine.gpu_memory_utilization,
            engine.mixed_graph_max_tokens) == ("torch", True, 0.5, 512)
    assert config_from_args(parser.parse_args([])).engine.mixed_graph_max_tokens == 2048
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        config_from_args(parser.parse_args(["--gpu-memory-utilization", "1.5"]))
    with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
        config_from_args(parser.parse_args(["--mixed-graph-max-tokens", "-1"]))


def test_kv_inline_bound_reaches_both_ends_of_the_kv_plane():
    """--kv-inline-max-mib sets TransferConfig.inline_max_bytes for the prefill workers' senders and the decode
    workers' receivers alike (a receiver with a smaller bound would end each larger transfer's connection); without
    it every gloo transfer rides the authenticated connection (None), so no gloo listener opens."""
    import argparse

    from cluster.serve import add_arguments, cluster_config, config_from_args
    from cluster.workers.actors import EngineSpec
    from cluster.workers.worker_template import worker_template
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(["--prefill-workers", "1", "--kv-inline-max-mib", "4"]))
    template = worker_template(cluster_config(config), EngineSpec("tiny", "float32", "cpu", config.engine, 1), "gloo")
    assert template.transfer.inline_max_bytes == template.receiver_transfer.inline_max_bytes == 4 << 20
    default = cluster_config(config_from_args(parser.parse_args(["--prefill-workers", "1"])))
    template = worker_template(default, EngineSpec("tiny", "float32", "cpu", config.engine, 1), "gloo")
    assert template.transfer.inline_max_bytes is template.receiver_transfer.inline_max_bytes is None
    for bad, message in ((["--prefill-workers", "1", "--kv-inline-max-mib", "2048"], "must be in"),
                         (["--kv-inline-max-mib", "64"], "needs --mode disaggregated")):
        with pytest.raises(ValueError, match=message):
            config_from_args(parser.parse_args(bad))


def test_serve_refuses_a_bad_model_before_starting_anything(tmp_path, capsys):
    """Colocated or disaggregated, a model file that is not GGUF is exit 2 naming it (an error, not an exception
    escaping main), before any worker starts: nothing is started below this process. In this process, as above."""
    bad = tmp_path / "model.gguf"
    bad.write_text("not a model")
    for mode in ((), ("--prefill-workers", "1")):
        with refused_before_starting_anything():
            assert cli.main(["serve", "--model", str(bad), *mode, "--grpc-port", "0", "--http-port", "0"]) == 2
        err = capsys.readouterr().err
        assert "model.gguf' is a file but not a GGUF file" in err and "Traceback" not in err, err[-2000:]


@contextlib.contextmanager
def refused_before_starting_anything():
    """Fails if the block connected this process to a Ray or started a process of its own (a Ray's GCS and
    raylet, an engine's rank): a child of this process that was not there before. Grandchildren are not counted:
    the session's local Ray, if it runs, may start pooled workers of its own meanwhile."""
    before, ray_before = children(), ray.is_initialized()
    yield
    assert ray.is_initialized() == ray_before, "the refused command started a Ray"
    started = {pid: command for pid, command in children().items() if pid not in before}
    assert not started, f"the refused command started processes: {started}"


def children() -> dict[int, str]:
    return {pid: info.command for pid, info in live_processes().items() if info.ppid == os.getpid()}
