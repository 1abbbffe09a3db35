"""The benchmarks' tables, printed through tabulate as GitHub Markdown (the form bench/RESULTS.md
keeps them in): one row per list, None shown as "-", one float format per column. tabulate comes
with the [bench] extra; it is imported when a table is printed, so that `--help` needs no extra."""

from __future__ import annotations


def markdown(headers: list[str], rows: list[list], floatfmt: tuple[str, ...]) -> str:
    """headers and rows as a Markdown table; floatfmt: each column's format for floats ("" for
    columns without numbers)."""
    try:
        from tabulate import tabulate
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "the benchmarks print their tables with tabulate: pip install -e '.[bench]'",
            name="tabulate",
        ) from e
    return tabulate(rows, headers=headers, tablefmt="github", floatfmt=floatfmt, missingval="-")
