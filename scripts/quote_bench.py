"""Copies the stored CPU benchmark run into the pages that quote it:

    python scripts/quote_bench.py        # after: python -m benchmarks ... > docs/bench_cpu.txt

- README.md, the rows after `<!-- bench-headline -->`: Qwen3-Next (H=16, Hv=32) from DRAM, every
  state dtype at B = 1, 32, 128 (ours us, GB/s, %copy, %rmw, reference us, vs ref);
- docs/benchmarks.md, the fenced blocks after `<!-- bench-full -->` (every table before the
  concurrent callers) and `<!-- bench-threads -->` (that table, without its caption).

tests/test_ci_command.py checks that the pages and the run agree. Prose that cites figures of
the run (ranges, the machine, the commit) is written by hand.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN = ROOT / "docs" / "bench_cpu.txt"
README = ROOT / "README.md"
PAGE = ROOT / "docs" / "benchmarks.md"
HEADLINE_B = (1, 32, 128)


def main_rows(text):
    """The first table (state from DRAM): (H, Hv, state, B) -> the fields after the key."""
    rows = {}
    for line in text.splitlines():
        if rows and not line.strip():
            break
        parts = line.split("|")
        if len(parts) != 3 or not parts[0].split() or not parts[0].split()[0].isdigit():
            continue
        h, hv, state, b = parts[0].split()
        rows[(int(h), int(hv), state, int(b))] = parts[1].split() + parts[2].split()
    return rows


def replace_block(page, marker, lines):
    """`page` with the fenced block right after `marker` replaced by `lines`."""
    head, sep, tail = page.partition(marker)
    assert sep and marker not in tail, f"expected {marker!r} once"
    m = re.match(r"(\s*```[^\n]*\n)(.*?)(\n```)", tail, re.S)
    assert m, f"no fenced block right after {marker!r}"
    return head + sep + m.group(1) + "\n".join(lines) + tail[m.start(3):]


def quote(text):
    rows = main_rows(text)
    readme = README.read_text()
    head, sep, tail = readme.partition("<!-- bench-headline -->")
    table = tail.lstrip("\n").splitlines()
    n = next(i for i, line in enumerate(table) if not line.startswith("|"))
    body = []
    for state in ("fp32", "bf16", "fp16"):
        for b in HEADLINE_B:
            r = rows[(16, 32, state, b)]
            body.append("| " + " | ".join([state, str(b), *r[:5], r[12]]) + " |")
    README.write_text(head + sep + "\n" + "\n".join(table[:2] + body + table[n:]) + "\n")

    main, caption, threads = text.rstrip("\n").partition("\n\nConcurrent callers")
    assert caption, f"{RUN} has no concurrent-callers table"
    page = replace_block(PAGE.read_text(), "<!-- bench-full -->", main.splitlines())
    page = replace_block(page, "<!-- bench-threads -->", threads.split("\n", 1)[1].splitlines())
    PAGE.write_text(page)


if __name__ == "__main__":
    quote(RUN.read_text())
