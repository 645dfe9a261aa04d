"""Reading, merging and summarising the files a recording (:mod:`jaxcomm.trace`) wrote.

Needs no MPI and no JAX: ``python -m jaxcomm.trace DIR`` runs it on any
machine that has the files. Times are nanoseconds on rank 0's clock: each
rank's clock is corrected by the offsets measured at the start and at the
end of the recording, interpolated linearly in between (drift).
"""

import collections
import dataclasses
import glob
import json
import os
import re

import numpy as np

# The kernels' record (jaxcomm/kernels/trace.h, TraceRecord), field by field.
RECORD = np.dtype(
    [
        ("start_ns", "<i8"),
        ("end_ns", "<i8"),
        ("site", "<i8"),
        ("comm", "<i8"),
        ("bytes", "<i8"),
        ("recv_bytes", "<i8"),
        ("request", "<i8"),
        ("kind", "<i4"),
        ("peer", "<i4"),
        ("source", "<i4"),
        ("tag", "<i4"),
        ("recvtag", "<i4"),
        ("failed", "<i4"),
        ("op", "S24"),
    ]
)
_MAGIC = b"JCTRACE\0"
_HEADER_BYTES = 16
NO_PEER = -(2**31)
CALL, START, WAIT, COPY, MEMBER = range(5)
KIND_NAMES = {CALL: "call", START: "start", WAIT: "wait", COPY: "copy"}
# Operations with a sending and a receiving side; every other one on a
# communicator is a collective (fence and status make no MPI call).
_P2P = {"send", "recv", "sendrecv", "isend", "irecv"}
_NOT_MPI = {"fence", "status"}


@dataclasses.dataclass
class Span:
    """One recorded span, with its peers as world ranks and its times on rank 0's clock.

    Attributes:
        rank: world rank that recorded it.
        kind: ``"call"``, ``"start"``, ``"wait"`` or ``"copy"``.
        op: operation label (for a wait: the operation it completes).
        start: start, in ns on rank 0's clock.
        end: end, in ns on rank 0's clock.
        site: call site text (``"?"`` if not recorded).
        comm: the communicator: its members' world ranks and its handle.
        bytes: bytes sent or contributed (-1: not known).
        recv_bytes: bytes a receive could take.
        dest: world rank sent to, or root (None: none).
        source: world rank received from (None: none or any).
        tag: tag sent with.
        recvtag: tag received with.
        request: request id linking a start and its wait (-1: none).
        failed: whether the call returned an error.
    """

    rank: int
    kind: str
    op: str
    start: int
    end: int
    site: str
    comm: tuple
    bytes: int
    recv_bytes: int
    dest: int | None
    source: int | None
    tag: int
    recvtag: int
    request: int
    failed: bool

    @property
    def duration(self) -> int:
        """``end - start``, in ns."""
        return self.end - self.start

    @property
    def name(self) -> str:
        """What the timeline and the summary call it: the op, ``wait <op>`` or ``copy <op>``."""
        return self.op if self.kind in ("call", "start") else f"{self.kind} {self.op}"


@dataclasses.dataclass
class RankFile:
    """What one rank's two files hold.

    Attributes:
        rank: world rank.
        header: the header line of the meta file.
        sites: call site texts by id.
        clocks: clock measurements by ``"start"``/``"end"``.
        records: the records (a structured array of :data:`RECORD`).
        end: the end line (None: the recording did not end, e.g. the process was killed).
        truncated: whether the record file ended inside a record.
    """

    rank: int
    header: dict
    sites: dict
    clocks: dict
    records: np.ndarray
    end: dict | None
    truncated: bool

    def offset_at(self, clock_ns):
        """What to add to this rank's clock at ``clock_ns`` to read rank 0's."""
        start, end = self.clocks.get("start"), self.clocks.get("end")
        if start is None:
            return 0
        if end is None or end["at_ns"] == start["at_ns"]:
            return start["offset_ns"]
        weight = (clock_ns - start["at_ns"]) / (end["at_ns"] - start["at_ns"])
        return start["offset_ns"] + weight * (end["offset_ns"] - start["offset_ns"])


def read_records(path):
    """The records of one ``rank<R>.bin`` and whether its tail was cut mid-record."""
    with open(path, "rb") as file:
        data = file.read()
    if len(data) < _HEADER_BYTES or data[:8] != _MAGIC:
        raise ValueError(f"{path}: not a jaxcomm trace file")
    version, size = np.frombuffer(data, "<u4", 2, 8)
    if version != 1 or size != RECORD.itemsize:
        raise ValueError(f"{path}: format version {version}, record size {size}: not readable here")
    count = (len(data) - _HEADER_BYTES) // RECORD.itemsize
    records = np.frombuffer(data, RECORD, count, _HEADER_BYTES)
    return records, (len(data) - _HEADER_BYTES) % RECORD.itemsize != 0


def read_rank(directory, rank):
    """One rank's files in ``directory`` (a missing or cut record file reads as what it holds)."""
    stem = os.path.join(directory, f"rank{rank:05d}")
    header, end, sites, clocks = None, None, {}, {}
    with open(stem + ".meta.jsonl", encoding="utf-8") as file:
        for line in file:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut by a killed process: the last one
            if entry["type"] == "header":
                header = entry
            elif entry["type"] == "site":
                sites[entry["id"]] = entry["text"]
            elif entry["type"] == "clock" and not entry.get("failed"):
                clocks[entry["when"]] = entry
            elif entry["type"] == "end":
                end = entry
    if header is None:
        raise ValueError(f"{stem}.meta.jsonl: no header")
    records, truncated = (
        read_records(stem + ".bin")
        if os.path.exists(stem + ".bin")
        else (np.zeros(0, RECORD), False)
    )
    return RankFile(rank, header, sites, clocks, records, end, truncated)


def read_directory(directory):
    """Every rank's files in ``directory``, by rank."""
    ranks = sorted(
        int(m.group(1))
        for path in glob.glob(os.path.join(directory, "rank*.meta.jsonl"))
        if (m := re.fullmatch(r"rank(\d+)\.meta\.jsonl", os.path.basename(path)))
    )
    if not ranks:
        raise FileNotFoundError(f"{directory}: no jaxcomm trace files (rank*.meta.jsonl)")
    return {rank: read_rank(directory, rank) for rank in ranks}


def _world(members, local, header):
    if local == NO_PEER or local == header["proc_null"] or local == header["any_source"]:
        return None
    if 0 <= local < len(members):
        return members[local]
    return None


def spans_of(rank_file):
    """The spans of one rank, in the order they ended, peers as world ranks."""
    header = rank_file.header
    members = collections.defaultdict(dict)
    # A span's members may come after it (a staging copy ends before its call).
    for record in rank_file.records[rank_file.records["kind"] == MEMBER]:
        members[int(record["comm"])][int(record["peer"])] = int(record["source"])
    out = []
    for record in rank_file.records:
        if record["kind"] == MEMBER:
            continue
        handle = int(record["comm"])
        local = members.get(handle, {})
        ordered = tuple(local[i] for i in range(len(local)))
        offset = rank_file.offset_at(int(record["start_ns"]))
        out.append(
            Span(
                rank=rank_file.rank,
                kind=KIND_NAMES.get(int(record["kind"]), "call"),
                op=record["op"].decode(errors="replace"),
                start=int(round(int(record["start_ns"]) + offset)),
                end=int(round(int(record["end_ns"]) + offset)),
                site=rank_file.sites.get(int(record["site"]), "?"),
                comm=(ordered, handle),
                bytes=int(record["bytes"]),
                recv_bytes=int(record["recv_bytes"]),
                dest=_world(ordered, int(record["peer"]), header),
                source=_world(ordered, int(record["source"]), header),
                tag=int(record["tag"]),
                recvtag=int(record["recvtag"]),
                request=int(record["request"]),
                failed=bool(record["failed"]),
            )
        )
    return out


@dataclasses.dataclass
class Trace:
    """A merged recording.

    Attributes:
        files: every rank's files, by rank.
        spans: every rank's spans, by rank, in the order they ended.
        window: ``(start, end)`` of the recording, in ns on rank 0's clock.
    """

    files: dict
    spans: dict
    window: tuple

    def wall(self, rank):
        """The recorded time of ``rank``: from its start to its end (or last span), in ns."""
        rank_file = self.files[rank]
        start = rank_file.header["clock_ns"] + rank_file.offset_at(rank_file.header["clock_ns"])
        if rank_file.end is not None:
            end = rank_file.end["clock_ns"] + rank_file.offset_at(rank_file.end["clock_ns"])
        else:
            end = max([s.end for s in self.spans[rank]], default=start)
        return max(end - start, 1)


def load(directory):
    """Read and merge the recording in ``directory``."""
    files = read_directory(directory)
    spans = {rank: spans_of(f) for rank, f in files.items()}
    starts = [f.header["clock_ns"] + f.offset_at(f.header["clock_ns"]) for f in files.values()]
    ends = [s.end for rank_spans in spans.values() for s in rank_spans]
    return Trace(files, spans, (int(min(starts)), int(max(ends, default=max(starts)))))


def clock_skew(trace):
    """How far the merged clocks can be off, per rank, in ns.

    ``uncertainty``: half the best round trip of the ping-pongs (the offset is
    known to within it at each measurement); ``drift``: how much the offset
    changed from the start to the end of the recording (corrected for by the
    interpolation, but a measure of how much the clocks wander).
    """
    out = {}
    for rank, f in trace.files.items():
        start, end = f.clocks.get("start"), f.clocks.get("end")
        half = [c["round_trip_ns"] / 2 for c in (start, end) if c is not None]
        out[rank] = {
            "uncertainty_ns": max(half) if half else None,
            "drift_ns": end["offset_ns"] - start["offset_ns"] if start and end else None,
        }
    return out


def is_collective(span):
    """Whether a span is a blocking collective call (one instance on every member rank)."""
    return span.kind == "call" and span.op not in _P2P and span.op not in _NOT_MPI


def collective_instances(trace):
    """Every blocking collective call, grouped into instances across the ranks.

    MPI requires every member of a communicator to make its collectives on it
    in the same order, so the n-th collective on a communicator on each
    member rank is one instance. Communicators are told apart by their
    members (their handles differ between ranks): communicators with the same
    members count as one, which holds for programs that call them in the same
    order on every rank, as SPMD programs do. Instances missing on some member
    (a rank's file ends first) are left out.

    Returns:
        A list of dicts: rank -> span, one per instance.
    """
    per_comm = collections.defaultdict(lambda: collections.defaultdict(list))
    for rank, spans in trace.spans.items():
        for span in spans:
            if is_collective(span) and span.comm[0]:
                per_comm[span.comm[0]][rank].append(span)
    instances = []
    for members, by_rank in per_comm.items():
        if any(m not in trace.files for m in members):
            continue
        for rank_spans in by_rank.values():
            rank_spans.sort(key=lambda s: s.start)
        count = min(len(by_rank.get(m, ())) for m in members)
        for i in range(count):
            instances.append({m: by_rank[m][i] for m in members})
    return instances


def late_arrivals(instance):
    """Each rank's wait in one collective instance, and the rank that arrived last.

    A rank's wait is the last arrival's start minus its own start (Scalasca's
    late arrival: time a rank spends in the call before the last one joins it),
    at most the rank's time in the call.
    """
    culprit = max(instance, key=lambda r: instance[r].start)
    last = instance[culprit].start
    waits = {r: min(max(last - s.start, 0), s.duration) for r, s in instance.items()}
    return waits, culprit


def _sends_and_receives(trace):
    """The p2p messages' two sides: sending spans and receiving spans, by message key."""
    sends = collections.defaultdict(list)
    receives = collections.defaultdict(list)
    for rank, spans in trace.spans.items():
        waits = {s.request: s for s in spans if s.kind == "wait"}
        header = trace.files[rank].header
        for span in spans:
            if span.op not in _P2P or span.kind not in ("call", "start"):
                continue
            if span.dest is not None and span.op in ("send", "sendrecv", "isend"):
                sends[(span.comm[0], rank, span.dest, span.tag)].append(span)
            if span.source is not None and span.op in ("recv", "sendrecv", "irecv"):
                tag = None if span.recvtag == header["any_tag"] else span.recvtag
                # A nonblocking receive has its message once its wait ends.
                side = waits.get(span.request, span) if span.kind == "start" else span
                receives[(span.comm[0], span.source, rank, tag)].append((span, side))
    return sends, receives


def messages(trace):
    """Every p2p message matched from its send to its receive.

    MPI delivers the messages of one sender to one receiver with one tag on
    one communicator in the order they were sent, so the n-th send matches
    the n-th receive of each (communicator, source, dest, tag). Where a
    receiver takes any tag from a sender, all that sender's messages to it on
    that communicator are matched in order instead. Receives from any source
    are not matched.

    Returns:
        A list of ``(send_span, receive_span, completing_span)``: the receive's
        own span (a nonblocking receive's start) and the one where its data is
        there (the receive itself, or its wait).
    """
    sends, receives = _sends_and_receives(trace)
    pairs = collections.defaultdict(lambda: ([], []))
    any_tag = {key[:3] for key in receives if key[3] is None}
    for key, sent in sends.items():
        pairs[key[:3] if key[:3] in any_tag else key][0].extend(sent)
    for key, got in receives.items():
        pairs[key[:3] if key[:3] in any_tag else key][1].extend(got)
    out = []
    for sent, got in pairs.values():
        sent = sorted(sent, key=lambda s: s.start)
        got = sorted(got, key=lambda r: r[0].start)
        out.extend((s, r, done) for s, (r, done) in zip(sent, got))
    return out


def p2p_waits(send, receive):
    """Late sender and late receiver time of one blocking message, in ns.

    Late sender: the receive (``recv``, or a ``sendrecv``'s receiving side)
    started before the send and waited for it (charged to the receiver).
    Late receiver: a ``send`` started before its receive was posted and could
    not finish before (charged to the sender), at most the send's own time.
    A ``sendrecv`` waiting for its partner is that partner's late send, never
    also a late receiver.
    """
    late_sender = 0
    late_receiver = 0
    if receive.kind == "call" and send.start > receive.start:
        late_sender = min(send.start, receive.end) - receive.start
    if send.kind == "call" and send.op == "send" and receive.start > send.start:
        late_receiver = min(receive.start, send.end) - send.start
    return late_sender, late_receiver


def summarize(trace):
    """The summary: per op, per call site, per rank, with the waits and their culprits.

    Returns:
        A dict (JSON-ready) with ``ranks`` (wall, in MPI, waiting, computing
        per rank), ``ops`` and ``sites`` (calls, bytes, total and mean time,
        share of the ranks' wall time, late-arrival / late-sender /
        late-receiver waits and the ranks that caused them) and ``clocks``.
    """
    walls = {rank: trace.wall(rank) for rank in trace.files}
    total_wall = sum(walls.values())
    rows = {"ops": {}, "sites": {}}

    def row(table, key):
        return rows[table].setdefault(
            key,
            {
                "calls": 0,
                "bytes": 0,
                "total_ns": 0,
                "wait_ns": 0,
                "late_sender_ns": 0,
                "late_receiver_ns": 0,
                "culprits": collections.Counter(),
            },
        )

    for spans in trace.spans.values():
        for span in spans:
            for table, key in (("ops", span.name), ("sites", f"{span.name} @ {span.site}")):
                r = row(table, key)
                r["calls"] += 1
                r["bytes"] += max(span.bytes, 0) + max(span.recv_bytes, 0)
                if span.kind != "copy":
                    r["total_ns"] += span.duration

    waiting = collections.Counter()
    charged = collections.Counter()

    def charge(span, field, culprit, ns):
        # A span waits at most its own time, whatever its messages say.
        ns = min(ns, span.duration - charged[id(span)])
        if ns <= 0:
            return
        charged[id(span)] += ns
        waiting[span.rank] += ns
        for table, key in (("ops", span.name), ("sites", f"{span.name} @ {span.site}")):
            r = row(table, key)
            r[field] += ns
            r["culprits"][culprit] += ns

    for instance in collective_instances(trace):
        waits, culprit = late_arrivals(instance)
        for rank, wait in waits.items():
            charge(instance[rank], "wait_ns", culprit, wait)
    for send, receive, _ in messages(trace):
        late_sender, late_receiver = p2p_waits(send, receive)
        charge(receive, "late_sender_ns", send.rank, late_sender)
        charge(send, "late_receiver_ns", receive.rank, late_receiver)

    for table in rows.values():
        for r in table.values():
            r["mean_ns"] = r["total_ns"] / r["calls"]
            r["share"] = r["total_ns"] / total_wall
            r["culprits"] = {str(k): v for k, v in r["culprits"].most_common()}

    ranks = {}
    for rank, spans in trace.spans.items():
        in_mpi = sum(s.duration for s in spans if s.kind != "copy" and s.op not in _NOT_MPI)
        ranks[str(rank)] = {
            "host": trace.files[rank].header["host"],
            "wall_ns": walls[rank],
            "mpi_ns": in_mpi,
            "waiting_ns": waiting[rank],
            "computing_ns": max(walls[rank] - in_mpi, 0),
            "spans": len(spans),
            "complete": trace.files[rank].end is not None,
        }
    return {
        "window_ns": trace.window[1] - trace.window[0],
        "ranks": ranks,
        "ops": dict(sorted(rows["ops"].items(), key=lambda kv: -kv[1]["total_ns"])),
        "sites": dict(sorted(rows["sites"].items(), key=lambda kv: -kv[1]["total_ns"])),
        "clocks": {str(k): v for k, v in clock_skew(trace).items()},
    }


def _culprit_text(culprits, limit=3):
    if not culprits:
        return ""
    return ", ".join(f"r{rank} {ns / 1e6:.3g} ms" for rank, ns in list(culprits.items())[:limit])


def _table(summary, table, limit):
    header = ["", "calls", "bytes", "total ms", "mean us", "share", "waits ms", "caused by"]
    lines = []
    here = os.getcwd() + os.sep
    for key, r in list(summary[table].items())[:limit]:
        waits = r["wait_ns"] + r["late_sender_ns"] + r["late_receiver_ns"]
        lines.append(
            [
                key.replace(here, ""),  # call sites under the current directory, relative
                str(r["calls"]),
                str(r["bytes"]),
                f"{r['total_ns'] / 1e6:.3f}",
                f"{r['mean_ns'] / 1e3:.2f}",
                f"{100 * r['share']:.1f}%",
                f"{waits / 1e6:.3f}",
                _culprit_text(r["culprits"]),
            ]
        )
    return header, lines


def _rank_table(summary):
    header = ["rank", "host", "wall ms", "computing", "in MPI", "waiting", "spans"]
    lines = []
    for rank, r in summary["ranks"].items():
        wall = r["wall_ns"]
        lines.append(
            [
                rank + ("" if r["complete"] else " (cut)"),
                r["host"],
                f"{wall / 1e6:.1f}",
                f"{100 * r['computing_ns'] / wall:.1f}%",
                f"{100 * (r['mpi_ns'] - r['waiting_ns']) / wall:.1f}%",
                f"{100 * r['waiting_ns'] / wall:.1f}%",
                str(r["spans"]),
            ]
        )
    return header, lines


def _clock_line(summary):
    values = [v for v in summary["clocks"].values() if v["uncertainty_ns"] is not None]
    if not values:
        return "clocks: not aligned (no measurement)"
    uncertainty = max(v["uncertainty_ns"] for v in values)
    drifts = [abs(v["drift_ns"]) for v in values if v["drift_ns"] is not None]
    drift = f", drift over the run up to {max(drifts) / 1e3:.1f} us" if drifts else ""
    return f"clocks aligned to rank 0 within {uncertainty / 1e3:.1f} us{drift}"


def format_text(summary, limit=15):
    """The summary as plain-text tables."""
    out = []
    for title, (header, lines) in (
        ("per rank (share of wall time)", _rank_table(summary)),
        ("per op", _table(summary, "ops", limit)),
        ("per call site", _table(summary, "sites", limit)),
    ):
        widths = [max(len(x) for x in col) for col in zip(header, *lines)]
        out.append(title)
        for line in [header, *lines]:
            out.append("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip())
        out.append("")
    out.append(_clock_line(summary))
    return "\n".join(out) + "\n"


def format_markdown(summary, limit=15):
    """The summary as Markdown tables."""
    out = []
    for title, (header, lines) in (
        ("Per rank (share of wall time)", _rank_table(summary)),
        ("Per op", _table(summary, "ops", limit)),
        ("Per call site", _table(summary, "sites", limit)),
    ):
        out += [f"**{title}**", "", "| " + " | ".join(header) + " |"]
        out.append("|" + "---|" * len(header))
        for line in lines:
            cells = (re.sub(r"([|<>])", r"\\\1", x) for x in line)  # Markdown, not HTML
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out.append(_clock_line(summary) + ".")
    return "\n".join(out) + "\n"


def chrome_trace(trace):
    """The merged timeline as Chrome trace events (Perfetto and chrome://tracing open it).

    One process per host, one thread (track) per rank; every span a complete
    event; each matched p2p message a flow from its send to where its receive
    completes. Times in microseconds from the start of the recording.
    """
    origin = trace.window[0]
    hosts = {}
    events = []
    for rank, rank_file in trace.files.items():
        host = rank_file.header["host"]
        pid = hosts.setdefault(host, len(hosts))
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid,
                "tid": rank,
                "args": {"name": f"rank {rank}"},
            }
        )
        events.append(
            {
                "ph": "M",
                "name": "thread_sort_index",
                "pid": pid,
                "tid": rank,
                "args": {"sort_index": rank},
            }
        )
    for host, pid in hosts.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": host}})

    def us(ns):
        return (ns - origin) / 1e3

    for rank, spans in trace.spans.items():
        pid = hosts[trace.files[rank].header["host"]]
        for span in spans:
            args = {"site": span.site, "comm size": len(span.comm[0])}
            if span.bytes > 0:
                args["bytes"] = span.bytes
            if span.recv_bytes > 0:
                args["recv bytes"] = span.recv_bytes
            for field in ("dest", "source"):
                if getattr(span, field) is not None:
                    args[field] = getattr(span, field)
            if span.op in _P2P:
                args["tag"] = span.tag if span.dest is not None else span.recvtag
            if span.request >= 0:
                args["request"] = span.request
            if span.failed:
                args["failed"] = True
            events.append(
                {
                    "ph": "X",
                    "name": span.name,
                    "cat": span.kind,
                    "pid": pid,
                    "tid": rank,
                    "ts": us(span.start),
                    "dur": max(span.duration / 1e3, 0.001),
                    "args": args,
                }
            )
    for n, (send, _, done) in enumerate(messages(trace)):
        for ph, span, ts in (("s", send, send.start), ("f", done, max(done.start, done.end - 1))):
            event = {
                "ph": ph,
                "id": n,
                "name": "message",
                "cat": "message",
                "pid": hosts[trace.files[span.rank].header["host"]],
                "tid": span.rank,
                "ts": us(ts),
            }
            if ph == "f":
                event["bp"] = "e"
            events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def plot(trace, summary, directory, seconds=1.0, start=0.0):
    """Two PNGs: time per rank (computing, in MPI, waiting) and ``seconds`` of the timeline.

    The timeline shows ``seconds`` from ``start`` seconds after the first MPI
    call.

    Needs matplotlib (``pip install jaxcomm[bench]``).

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(trace.files)
    fig, ax = plt.subplots(figsize=(6, 0.4 * len(ranks) + 1.2))
    left = np.zeros(len(ranks))
    for label, field, color in (
        ("computing", "computing_ns", "#9bb7d4"),
        ("in MPI", None, "#f2b45a"),
        ("waiting", "waiting_ns", "#d1495b"),
    ):
        r = [summary["ranks"][str(rank)] for rank in ranks]
        values = np.array(
            [(x["mpi_ns"] - x["waiting_ns"]) if field is None else x[field] for x in r], float
        ) / np.array([x["wall_ns"] for x in r], float)
        ax.barh(ranks, 100 * values, left=100 * left, color=color, label=label)
        left += values
    ax.set_xlabel("share of the rank's recorded time (%)")
    ax.set_ylabel("rank")
    ax.set_yticks(ranks)
    ax.invert_yaxis()
    ax.legend(ncols=3, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    split = os.path.join(directory, "ranks.png")
    fig.savefig(split, dpi=100)
    plt.close(fig)

    # From the first MPI call: a recording's start is often followed by
    # seconds of compilation.
    first = min((s.start for spans in trace.spans.values() for s in spans), default=trace.window[0])
    origin = first + start * 1e9
    limit = origin + seconds * 1e9
    names = sorted({s.name for spans in trace.spans.values() for s in spans if s.kind != "copy"})
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(names)}
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(ranks) + 1.5))
    for rank in ranks:
        for name in names:
            bars = [
                ((s.start - first) / 1e6, max(s.duration / 1e6, 1e-3))
                for s in trace.spans[rank]
                if s.name == name and s.start < limit and s.end > origin
            ]
            if bars:
                ax.broken_barh(bars, (rank - 0.4, 0.8), color=colors[name], label=name)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(
        unique.values(),
        unique.keys(),
        ncols=4,
        fontsize=8,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        frameon=False,
    )
    ax.set_xlim(start * 1e3, (start + seconds) * 1e3)
    ax.set_xlabel("time since the first MPI call (ms, rank 0's clock)")
    ax.set_ylabel("rank")
    ax.set_yticks(ranks)
    ax.invert_yaxis()
    fig.tight_layout()
    timeline = os.path.join(directory, "timeline.png")
    fig.savefig(timeline, dpi=100)
    plt.close(fig)
    return [split, timeline]
