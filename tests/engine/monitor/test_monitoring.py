"""Per-rank monitoring through the trainer, one process (engine/monitor/ranks.py, sinks.py,
engine/train/assemble.py start_monitoring): TensorBoard reads the event files back, also
after a resume; the Prometheus text file and port parse with prometheus_client's parser;
the flags' nonsense is refused before any step; --monitor-every 0 turns the per-rank
section off. The MPI side (DP, PP, TP, a straggler) is test_monitoring_mpi.py."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from mpi4py import MPI

from ringpipe.engine.train.config import Config
from ringpipe.engine.train.run import run
from tests.support import ROOT

SPLIT = ("compute", "comm", "bubble", "data", "other")
TINY = dict(data="synthetic", layers=2, d_model=32, heads=2, context=32, seq_len=32, batch_size=8,
            sample_tokens=0, quiet=True, overwrite=True)
TINY_FLAGS = ["--data", "synthetic", "--layers", "2", "--d-model", "32", "--heads", "2", "--context", "32",
              "--seq-len", "32", "--batch-size", "8", "--sample-tokens", "0", "--quiet"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")


def train(out, **settings):
    return run(Config(**{**TINY, **settings}, out=str(out)), world=MPI.COMM_SELF)


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port):
    """A server could bind the port now (with SO_REUSEADDR, as http.server does: a connection
    the test made may leave the port in TIME_WAIT for a minute, which is no open server)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def nobody_answers(port):
    with socket.socket() as s:
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
        return False


# ---- TensorBoard ---------------------------------------------------------------------------

def test_tensorboard_reads_back_every_step_once_after_a_resume(tmp_path):
    """A run of 10 steps, then a resume from its step-5 checkpoint: TensorBoard's reader sees
    train/loss at steps 1..10 once each (purge_step hides what the first run wrote past the
    checkpoint), with metrics.jsonl's values of the last run of each step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = str(tmp_path / "tb")
    train(out, steps=10, checkpoint_every=5, keep=0, monitor_every=2, eval_every=5)
    train(out, steps=10, monitor_every=2, eval_every=5, overwrite=False,
          resume=os.path.join(out, "checkpoints", "ckpt_00000005.json"))
    last = {r["step"]: r for r in records(out)}           # the resumed run's records come last
    assert sorted(last) == list(range(1, 11))

    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 11)), [e.step for e in loss]
    for e in loss:
        assert e.value == pytest.approx(last[e.step]["loss"], rel=1e-6), e.step
    assert "rank_compute_ms/rank_000" in tags and "rank_step_ms/rank_000" in tags
    assert "val/loss" in tags
    assert [e.step for e in events.Scalars("val/loss")] == [5, 10]


def test_no_tensorboard_writes_no_event_files(tmp_path):
    out = str(tmp_path / "plain")
    train(out, steps=2, tensorboard=False, monitor_every=1)
    assert os.path.exists(os.path.join(out, "metrics.jsonl"))
    assert not os.path.exists(os.path.join(out, "tensorboard"))


# ---- Prometheus ----------------------------------------------------------------------------

def families(text):
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_the_prometheus_text_file_parses(tmp_path):
    out, prom = str(tmp_path / "prom"), str(tmp_path / "x.prom")
    train(out, steps=6, monitor_every=2, tensorboard=False, metrics_textfile=prom)
    with open(prom) as fh:
        found = families(fh.read())
    (step,) = found["ringpipe_step"].samples
    assert step.value == 6 and step.labels == {"job": "prom"}
    (loss,) = found["ringpipe_loss"].samples
    assert loss.value == records(out)[-1]["loss"]
    parts = {s.labels["part"]: s.value for s in found["ringpipe_rank_step_part_seconds"].samples
             if s.labels["rank"] == "0"}
    assert sorted(parts) == sorted(SPLIT)
    assert all(v >= 0 for v in parts.values())
    assert found["ringpipe_rank_resident_bytes"].samples[0].value > 0


def test_the_text_file_is_replaced_only_by_a_run_of_its_own_directory(tmp_path):
    """Its first line names the run directory (sinks.py check_textfile): a run there again
    replaces it; a run elsewhere, or any file not ringpipe's, is refused before any work."""
    from ringpipe.engine.job.errors import ConfigError
    out, prom = str(tmp_path / "prom"), tmp_path / "x.prom"
    train(out, steps=2, monitor_every=1, tensorboard=False, metrics_textfile=str(prom))
    first = prom.read_text()
    train(out, steps=3, monitor_every=1, tensorboard=False, metrics_textfile=str(prom))     # the same directory
    assert prom.read_text() != first and families(prom.read_text())["ringpipe_step"].samples[0].value == 3
    written = prom.read_text()
    with pytest.raises(ConfigError, match="holds the metrics of another ringpipe run"):
        train(tmp_path / "other", steps=2, tensorboard=False, metrics_textfile=str(prom))
    theirs = tmp_path / "node.prom"
    theirs.write_text("node_thing 1\n")
    with pytest.raises(ConfigError, match="exists and is not a file ringpipe wrote"):
        train(tmp_path / "third", steps=2, tensorboard=False, metrics_textfile=str(theirs))
    assert prom.read_text() == written and theirs.read_text() == "node_thing 1\n"
    # refused before --out is made: a refused run leaves no folder behind
    assert not (tmp_path / "other").exists() and not (tmp_path / "third").exists()


def test_the_metrics_port_serves_while_the_run_goes_and_closes_after(tmp_path):
    port = free_port()
    out = str(tmp_path / "port")
    loud = [f for f in TINY_FLAGS if f != "--quiet"]            # the Prometheus line is a start-up fact
    child = subprocess.Popen([sys.executable, "-m", "ringpipe.train", *loud, "--steps", "400",
                              "--monitor-every", "10", "--no-tensorboard", "--metrics-port", str(port),
                              "--out", out], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        text, deadline = None, time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                    text = answer.read().decode()
                if "ringpipe_step{" in text:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.1)
        assert text is not None and "ringpipe_step{" in text, child.poll()
        (step,) = families(text)["ringpipe_step"].samples
        assert 1 <= step.value <= 400
        stdout, stderr = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.terminate()
            child.wait(timeout=30)
    assert child.returncode == 0, stderr
    assert f"Prometheus: http://127.0.0.1:{port}/metrics" in stdout
    assert nobody_answers(port) and port_is_free(port)


def test_a_second_run_in_the_same_process_can_take_the_same_port(tmp_path):
    """Sinks.close shuts the HTTP server down: a library caller's process goes on after run()."""
    port = free_port()
    for name in ("first", "second"):
        train(tmp_path / name, steps=2, monitor_every=1, tensorboard=False, metrics_port=port)
        assert port_is_free(port), f"the {name} run left port {port} open"


# ---- refusals ------------------------------------------------------------------------------

def cli(*args):
    return subprocess.run([sys.executable, "-m", "ringpipe.train", *TINY_FLAGS, "--steps", "2", *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("flags, says", [
    (["--metrics-textfile", "x.txt"], ["--metrics-textfile x.txt", "*.prom", "name the file so"]),
    (["--metrics-textfile", "/nonexistent-folder/x.prom"],
     ["--metrics-textfile /nonexistent-folder/x.prom", "does not exist", "name a file in a folder you can write"]),
    (["--monitor-every", "-1"], ["--monitor-every", "a whole number >= 0", "got -1"]),
    (["--monitor-every", "abc"], ["--monitor-every", "expected a whole number of steps or auto", "'abc'"]),
    (["--straggler-ratio", "1"], ["--straggler-ratio must be > 1", "got 1.0"]),
    (["--straggler-intervals", "0"], ["--straggler-intervals must be >= 1", "got 0"]),
    (["--metrics-port", "70000"], ["--metrics-port must be a TCP port, 1 to 65535", "got 70000"]),
], ids=["textfile-not-prom", "textfile-folder-missing", "every-negative", "every-not-a-number", "ratio-1",
        "intervals-0", "port-out-of-range"])
def test_monitoring_nonsense_is_refused_before_any_step(tmp_path, flags, says):
    out = tmp_path / "refused"
    r = cli("--out", str(out), *flags)
    assert r.returncode == 2, (r.stdout, r.stderr)
    for words in says:
        assert words in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (out / "metrics.jsonl").exists()


# ---- off -----------------------------------------------------------------------------------

def test_monitor_every_0_leaves_out_the_per_rank_section(tmp_path, capsys):
    out = str(tmp_path / "off")
    train(out, steps=6, monitor_every=0, tensorboard=False)
    printed = capsys.readouterr().out
    assert len(records(out)) == 6
    assert not any("ranks" in r or "stragglers" in r for r in records(out))
    assert "straggler" not in printed
    with open(os.path.join(out, "job_summary.json")) as fh:
        summary = json.load(fh)
    assert summary["job"]["steps"] == 6 and len(summary["ranks"]) == 1
