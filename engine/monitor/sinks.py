"""Where rank 0 sends each step's record besides metrics.jsonl: TensorBoard event files
and Prometheus (a text file for node_exporter's textfile collector, or a port).

    sinks = Sinks.open(out_dir, start_step, tensorboard=True, textfile=None, port=None, say=print)
    sinks.publish(record)          # every step, after metrics.jsonl has it: a queue put, nothing more
    sinks.close()                  # the end of the run: everything queued is written

Encoding events costs tens of microseconds a scalar (a Python protobuf per value): a dozen a
step would be a millisecond of the training thread. So the records go to a
queue, and one background thread writes them. A sink that fails (a full disk, a port
taken) says so once and stops; it never stops the training, which metrics.jsonl records.

TensorBoard: OUT/tensorboard/, one event file per (re)start; a resumed run passes
purge_step, so the steps an interrupted run wrote past its checkpoint are hidden and
the resumed ones continue the same step axis. Scalars: train/*, val/*, and per rank
rank_<metric>/rank_<R> (one group per metric: the ranks side by side). A classifier's
confusion matrix is a text table (val/confusion) from the record in memory, which still
holds it: only metrics.jsonl's copy leaves it out (confusion.py writes it to a file).

Prometheus: gauges named ringpipe_*, labelled by job (the Slurm job id or the run
directory's name), and per rank by rank and node. The text file is rewritten
atomically (a temporary file renamed over it) at every per-rank interval and at the
end; the port (rank 0, --metrics-port, bound to localhost unless --metrics-host says
otherwise) serves the values of the newest step.

The text file sits in node_exporter's textfile folder beside other exporters' files: its
first line says which run directory's run wrote it (textfile_header), and only a run of
that directory replaces it (check_textfile: at start-up, refused with a ConfigError on
every rank before any work, and again before each write). Any other file there is left
alone, whatever its name.
"""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import threading
import time

from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.job.files import UnreadableFile, open_regular, write_text_atomic
from ringpipe.engine.monitor.ranks import SPLIT

TENSORBOARD_DIR = "tensorboard"
# The step record's scalars and their TensorBoard tags.
TAGS = {"loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
        "step_ms": "train/step_ms", "tokens_per_s": "train/tokens_per_s", "examples_per_s": "train/examples_per_s",
        "model_flops_per_s": "train/model_flops_per_s", "mfu": "train/mfu", "epoch": "train/epoch",
        "comm_hidden_frac": "train/comm_hidden_fraction", "val_loss": "val/loss", "val_bpb": "val/bits_per_byte",
        "val_accuracy": "val/accuracy"}
# The text file's first line (a comment to Prometheus): the mark, then the run directory.
TEXTFILE_MARK = "# ringpipe metrics of the run in "
# The confusion matrix goes to TensorBoard as a table up to this many classes; a larger one
# is unreadable as text (and megabytes an event): OUT/val_confusion.json has it.
CONFUSION_TABLE_LIMIT = 64
RANK_VALUES = ("step_ms", "compute_ms", "comm_ms", "bubble_ms", "data_ms", "other_ms", "items_per_s",
               "rss_bytes", "peak_bytes", "cpu_percent", "net_rx_bytes_per_s", "net_tx_bytes_per_s",
               "gpu_util_percent", "gpu_mem_bytes")


class MissingLibrary(RuntimeError):
    """A sink was asked for whose library is not installed; the message says what to install."""


def confusion_table(rows: list) -> str:
    """The confusion matrix as a Markdown table (TensorBoard's text plugin draws it), up to
    CONFUSION_TABLE_LIMIT classes; a larger one is named, not drawn (its file has it)."""
    if len(rows) > CONFUSION_TABLE_LIMIT:
        return (f"{len(rows)} classes: too many for a table here (at most {CONFUSION_TABLE_LIMIT}); the run "
                "directory's val_confusion.json holds the matrix, `ringpipe report` each class's precision "
                "and recall")
    table = "| true \\ predicted | " + " | ".join(map(str, range(len(rows)))) + " |\n"
    table += "|---" * (len(rows) + 1) + "|\n"
    return table + "".join(f"| {i} | " + " | ".join(map(str, row)) + " |\n" for i, row in enumerate(rows))


class TensorBoardSink:
    """Event files through TensorBoard's own writer (the `tensorboard` package's EventFileWriter
    and protos, as torch.utils.tensorboard uses them: no TensorFlow, no PyTorch). tensorboardX
    was the first choice, and was dropped: it imports torch whenever torch is installed (2 s and
    195 MiB on rank 0, measured here). The writer is made on the sinks' thread at the first
    record, so its import (0.6 s) never delays the start-up."""

    def __init__(self, folder: str, start_step: int):
        if importlib.util.find_spec("tensorboard") is None:
            raise MissingLibrary("TensorBoard event files need the tensorboard package: pip install "
                                 "'ringpipe[monitor]' (or tensorboard), or pass --no-tensorboard")
        self.folder, self.start_step = folder, start_step
        self.writer = None

    def _open(self):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        # The file name holds the second it was made and the host: a resume within the same second
        # would truncate the earlier file without a suffix of its own.
        self.writer = EventFileWriter(self.folder, max_queue_size=1000, flush_secs=10,
                                      filename_suffix=f".step{self.start_step}.pid{os.getpid()}")
        if self.start_step:
            # A resumed run: TensorBoard hides what an interrupted run wrote from the first step this
            # one writes on (records count steps done: the checkpoint's own step is kept).
            purge = self.start_step + 1
            self.writer.add_event(event_pb2.Event(step=purge, wall_time=time.time(), session_log=event_pb2.SessionLog(
                status=event_pb2.SessionLog.START)))

    def _scalars(self, step: int, values: list) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=float(v))
                                             for tag, v in values])
        self.writer.add_event(event_pb2.Event(summary=summary, step=step, wall_time=time.time()))

    def _text(self, step: int, tag: str, text: str) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()],
                                        tensor_shape=tensor_shape_pb2.TensorShapeProto(
                                            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]))
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor)])
        self.writer.add_event(event_pb2.Event(summary=summary, step=step, wall_time=time.time()))

    def write(self, record: dict) -> None:
        if self.writer is None:
            self._open()
        step, values = record["step"], []
        for key, tag in TAGS.items():
            value = record.get(key)
            if isinstance(value, (int, float)):
                values.append((tag, value))
        for which in ("precision", "recall"):
            for k, value in enumerate(record.get(f"val_{which}") or []):
                if value is not None:
                    values.append((f"val_{which}/class_{k}", value))
        for row in record.get("ranks", ()):
            for key in RANK_VALUES:
                if key in row:
                    values.append((f"rank_{key}/rank_{row['rank']:03d}", row[key]))
        if "stragglers" in record:
            values.append(("train/stragglers", len(record["stragglers"])))
        self._scalars(step, values)                  # one event a step: its scalars together
        if "val_confusion" in record:
            self._text(step, "val/confusion", confusion_table(record["val_confusion"]))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def textfile_header(out_dir: str) -> str:
    """The text file's first line: whose it is (the run directory, quoted: any path stays one line)."""
    return f"{TEXTFILE_MARK}{json.dumps(os.path.realpath(out_dir))}; only a run of that directory replaces this file\n"


def check_textfile(path: str | None, out_dir: str) -> None:
    """<metrics_textfile> may be written by the run in `out_dir`: a new file, or one a run of
    the same run directory wrote (a resumed or restarted run replaces its own). Anything else
    (another exporter's file, another run's, a link, a folder) raises ConfigError: never
    replaced. None (no text file asked for) passes."""
    if path is None or not os.path.lexists(path):
        return
    where = f"<metrics_textfile> {path}"
    if os.path.islink(path):
        raise ConfigError(f"{where} is a symbolic link: ringpipe replaces only a file it wrote there; name another "
                          "file (node_exporter reads every *.prom in its folder)")
    try:
        fd = open_regular(path, where, follow_symlinks=False)     # a FIFO there must not block
    except UnreadableFile as e:
        raise ConfigError(f"{e}; name another file") from None
    try:
        first = os.pread(fd, 4096, 0).split(b"\n", 1)[0].decode("utf-8", errors="replace")
    finally:
        os.close(fd)
    if first + "\n" == textfile_header(out_dir):
        return
    if first.startswith(TEXTFILE_MARK):
        raise ConfigError(f"{where} holds the metrics of another ringpipe run ({first[len(TEXTFILE_MARK):][:300]}): "
                          "two runs would overwrite each other's. Name a file of this run's own, e.g. "
                          f"{os.path.join(os.path.dirname(path), os.path.basename(os.path.abspath(out_dir)) + '.prom')}"
                          ", or remove that one if its run is over")
    raise ConfigError(f"{where} exists and is not a file ringpipe wrote (another exporter's?): it is left alone. "
                      "Name another file (node_exporter reads every *.prom in its folder), or remove it if nothing "
                      "needs it")


class PrometheusSink:
    def __init__(self, job: str, textfile: str | None, port: int | None, host: str, out_dir: str = "."):
        try:
            import prometheus_client as pc
        except ImportError:
            raise MissingLibrary("--metrics-textfile and --metrics-port need the prometheus_client package: pip "
                                 "install 'ringpipe[monitor]' (or prometheus_client)") from None
        self.pc, self.textfile, self.out_dir = pc, textfile, out_dir
        check_textfile(textfile, out_dir)
        self.registry = pc.CollectorRegistry()
        self.job = job

        def gauge(name, about, labels=()):
            return pc.Gauge(f"ringpipe_{name}", about, ("job",) + tuple(labels), registry=self.registry)
        self.step = gauge("step", "the last step done")
        self.scalars = {key: gauge(name, about) for key, name, about in (
            ("loss", "loss", "training loss of the last step"),
            ("lr", "learning_rate", "learning rate of the last step"),
            ("grad_norm", "grad_norm", "global gradient norm of the last step (before clipping)"),
            ("step_ms", "step_seconds", "the last step's time in seconds"),
            ("tokens_per_s", "tokens_per_second", "tokens trained on per second"),
            ("examples_per_s", "examples_per_second", "examples trained on per second"),
            ("model_flops_per_s", "model_flops_per_second", "model FLOP/s (6N per token and attention)"),
            ("mfu", "mfu_ratio", "model FLOP/s over the GEMM peak measured at start-up"),
            ("val_loss", "val_loss", "the last validation loss"),
            ("val_bpb", "val_bits_per_byte", "the last validation's bits per byte"),
            ("val_accuracy", "val_accuracy_ratio", "the last validation's accuracy"))}
        self.split = gauge("rank_step_part_seconds", "mean seconds per step in each part of the step",
                           ("rank", "node", "part"))
        self.rank_values = {key: gauge(name, about, ("rank", "node")) for key, name, about in (
            ("step_ms", "rank_step_seconds", "the rank's mean step time over the last interval"),
            ("items_per_s", "rank_items_per_second", "items the rank's replica trained on per second"),
            ("rss_bytes", "rank_resident_bytes", "the rank's resident memory"),
            ("peak_bytes", "rank_peak_resident_bytes", "the rank's peak resident memory"),
            ("cpu_percent", "rank_cpu_percent", "the rank's CPU use (100 = one core)"),
            ("gpu_util_percent", "rank_gpu_utilization_percent", "the rank's GPU utilisation (NVML)"),
            ("gpu_mem_bytes", "rank_gpu_memory_used_bytes", "the rank's GPU memory in use (NVML)"))}
        # The node's network is the node's: one series a node, not one a rank (a sum by node would
        # count it once per rank).
        self.node_values = {key: gauge(name, about, ("node",)) for key, name, about in (
            ("net_rx_bytes_per_s", "node_network_receive_bytes_per_second", "the node's interfaces but loopback"),
            ("net_tx_bytes_per_s", "node_network_transmit_bytes_per_second", "the node's interfaces but loopback"))}
        self.straggler = gauge("rank_straggler", "1 while the rank is named a straggler", ("rank", "node", "what"))
        self.named = set()
        self.server = None
        if port is not None:
            self.server, _ = self.pc.start_http_server(port, addr=host, registry=self.registry)

    def write(self, record: dict) -> None:
        job = self.job
        self.step.labels(job).set(record["step"])
        for key, g in self.scalars.items():
            if isinstance(record.get(key), (int, float)):
                value = record[key] / 1e3 if key == "step_ms" else record[key]
                g.labels(job).set(value)
        if "ranks" not in record:
            return
        for row in record["ranks"]:
            rank, node = str(row["rank"]), row["node"]
            for part in SPLIT:
                if f"{part}_ms" in row:
                    self.split.labels(job, rank, node, part).set(row[f"{part}_ms"] / 1e3)
            for key, g in self.rank_values.items():
                if key in row:
                    g.labels(job, rank, node).set(row[key] / 1e3 if key == "step_ms" else row[key])
            for key, g in self.node_values.items():
                if key in row:
                    g.labels(job, node).set(row[key])          # every rank of a node reads the same counters
        named = {(str(s["rank"]), s["node"], s["what"]) for s in record.get("stragglers", ())}
        for labels in self.named | named:
            self.straggler.labels(job, *labels).set(1 if labels in named else 0)
        self.named = named
        if self.textfile:
            self.write_textfile()

    def write_textfile(self) -> None:
        """The text file, whole (a temp file renamed over it), its first line whose it is. Checked
        again first: a file put there since the start is another's, and stops this sink."""
        check_textfile(self.textfile, self.out_dir)
        text = textfile_header(self.out_dir) + self.pc.generate_latest(self.registry).decode("utf-8")
        write_text_atomic(self.textfile, text)

    def close(self) -> None:
        if self.server is not None:       # the port is free again when run() returns (a library caller's process goes on)
            self.server.shutdown()
            self.server.server_close()
        if self.textfile:
            self.write_textfile()


class Sinks:
    """rank 0's sinks, written by one background thread."""

    def __init__(self, sinks: list, say):
        self.sinks, self.say = sinks, say
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="ringpipe-monitor-sinks", daemon=True)
        if sinks:
            self.thread.start()

    @classmethod
    def open(cls, out_dir: str, start_step: int, *, tensorboard: bool, textfile: str | None, port: int | None,
             host: str = "127.0.0.1", job: str | None = None, say=print):
        """The sinks asked for. Raises MissingLibrary when a library is not installed, OSError
        when a port cannot be bound, ConfigError for a text file not this run directory's
        (check_textfile; all before any step)."""
        sinks = []
        if tensorboard:
            sinks.append(TensorBoardSink(os.path.join(out_dir, TENSORBOARD_DIR), start_step))
        if textfile or port is not None:
            sinks.append(PrometheusSink(job or os.path.basename(os.path.abspath(out_dir)), textfile, port, host,
                                        out_dir))
        return cls(sinks, say)

    def publish(self, record: dict) -> None:
        if self.sinks:
            self.queue.put(record)

    def _run(self) -> None:
        while True:
            record = self.queue.get()
            if record is None:
                return
            for sink in list(self.sinks):
                try:
                    sink.write(record)
                except Exception as e:            # a sink is a view: it never stops the training
                    self.sinks.remove(sink)
                    self.say(f"warning: {type(sink).__name__} stopped after step {record.get('step')}: {e} "
                             "(metrics.jsonl goes on recording every step)")

    def close(self) -> None:
        if not self.thread.is_alive():
            return
        self.queue.put(None)
        self.thread.join()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:
                self.say(f"warning: {type(sink).__name__} could not close: {e}")
