"""``python -m jaxcomm.trace DIR``: merge a recording into one timeline and summarise it."""

import argparse
import json
import os
import sys

from . import analysis


def main(argv=None) -> int:
    """Merge and summarise the recording in a directory (see ``--help``).

    Args:
        argv: the arguments (default: the command line's).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m jaxcomm.trace",
        description="Merge the per-rank files of a jaxcomm recording (JAXCOMM_TRACE=DIR or "
        "jaxcomm.trace(DIR)) into DIR/trace.json (open it in https://ui.perfetto.dev or "
        "chrome://tracing), write the summary to DIR/summary.json and DIR/summary.md, and "
        "print it.",
    )
    parser.add_argument("directory", help="the recording's directory")
    parser.add_argument(
        "--png", action="store_true", help="also draw ranks.png and timeline.png (matplotlib)"
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=1.0,
        help="how much of the timeline timeline.png shows (default 1)",
    )
    parser.add_argument(
        "--start",
        type=float,
        default=0.0,
        help="where timeline.png starts, in seconds after the first MPI call (default 0)",
    )
    parser.add_argument("--rows", type=int, default=15, help="rows per printed table (default 15)")
    args = parser.parse_args(argv)

    trace = analysis.load(args.directory)
    summary = analysis.summarize(trace)
    with open(os.path.join(args.directory, "trace.json"), "w", encoding="utf-8") as file:
        json.dump(analysis.chrome_trace(trace), file)
    with open(os.path.join(args.directory, "summary.json"), "w", encoding="utf-8") as file:
        json.dump(summary, file, indent=1)
    with open(os.path.join(args.directory, "summary.md"), "w", encoding="utf-8") as file:
        file.write(analysis.format_markdown(summary, args.rows))
    sys.stdout.write(analysis.format_text(summary, args.rows))
    if args.png:
        try:
            written = analysis.plot(trace, summary, args.directory, args.seconds, args.start)
        except ImportError:
            sys.stderr.write(
                "jaxcomm.trace: --png needs matplotlib (pip install 'jaxcomm[bench]')\n"
            )
            return 1
        sys.stdout.write("wrote " + ", ".join(written) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
