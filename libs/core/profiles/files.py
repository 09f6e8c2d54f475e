"""Reading research data files: numeric CSV cells, CSV rows and JSON documents, each
error naming the file, the line and the field at fault."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def number_cell(path: Path, line: int, field: str, raw: str | None, *, positive: bool) -> float:
    """Parse one numeric CSV cell, naming file, line and field when it is malformed."""
    try:
        value = float(raw) if raw is not None else math.nan
    except ValueError:
        value = math.nan
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0)
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(
            f"{path}, line {line}, field {field!r}: expected a finite number {bound}, got {raw!r}"
        )
    return value


def integer_cell(path: Path, line: int, field: str, raw: str | None) -> int:
    value = number_cell(path, line, field, raw, positive=True)
    if value != int(value):
        raise ValueError(f"{path}, line {line}, field {field!r}: expected an integer, got {raw!r}")
    return int(value)


def csv_rows(path: Path, fields: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """Rows of a CSV file with the line number each ends on; checks the header."""
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [f for f in fields if f not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(
                f"{path}, line 1, field {missing[0]!r}: missing from the header "
                f"(expected columns {', '.join(fields)})"
            )
        for row in reader:
            yield reader.line_num, row


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text("utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {err.lineno}: not valid JSON ({err.msg})") from err


def finite_rate(path: Path, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{path}: {where}: expected a finite number of steps/s, got {value!r}")
    return float(value)
