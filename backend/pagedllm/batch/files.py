"""Input rows and result files for `pagedllm batch`.

Inputs: JSONL, CSV or Parquet, chosen by extension. Results are appended to a JSONL journal and flushed as
each request finishes, so an interrupted run loses nothing; a `.parquet` output is written from the journal
when the run completes (the journal, `<output>.partial.jsonl`, is what `--resume` reads until then).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator

INPUT_FORMATS = (".jsonl", ".csv", ".parquet")
OUTPUT_FORMATS = (".jsonl", ".parquet")


def read_rows(path: str) -> Iterator[dict]:
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    row = {"__error__": f"line {lineno}: invalid JSON ({e.msg})"}
                yield row if isinstance(row, dict) else {"__error__": f"line {lineno}: not a JSON object"}
    elif ext == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                yield {k: v for k, v in row.items() if v != ""}  # empty cells mean "not given"
    elif ext == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches():
            for row in batch.to_pylist():
                yield {k: v for k, v in row.items() if v is not None}
    else:
        raise ValueError(f"input: unsupported format {ext!r}; use one of {', '.join(INPUT_FORMATS)}")


class ResultWriter:
    def __init__(self, path: str, resume: bool) -> None:
        ext = os.path.splitext(path)[1].lower()
        if ext not in OUTPUT_FORMATS:
            raise ValueError(f"output: unsupported format {ext!r}; use one of {', '.join(OUTPUT_FORMATS)}")
        self.path = path
        self.journal = path if ext == ".jsonl" else path + ".partial.jsonl"
        self.done_ids: set[str] = set()
        if resume:
            self.done_ids = {str(r["id"]) for r in _read_journal(self.journal)}
            if ext == ".parquet" and not self.done_ids and os.path.exists(path):
                import pyarrow.parquet as pq

                self.done_ids = {str(i) for i in pq.read_table(path, columns=["id"]).column("id").to_pylist()}
                _write_journal_from_parquet(path, self.journal)
        elif os.path.exists(self.journal):
            os.remove(self.journal)
        self._f = open(self.journal, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._f.flush()  # finished work survives an interruption
        self.done_ids.add(str(record["id"]))

    def close(self) -> None:
        self._f.close()
        if self.journal != self.path:
            import pyarrow as pa
            import pyarrow.parquet as pq

            records = list(_read_journal(self.journal))
            columns = ["id", "text", "num_prompt_tokens", "num_output_tokens", "finish_reason", "error"]
            table = pa.table({c: [r.get(c) for r in records] for c in columns})
            pq.write_table(table, self.path)
            os.remove(self.journal)


def _read_journal(path: str) -> Iterator[dict]:
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by the interruption: that request runs again


def _write_journal_from_parquet(parquet_path: str, journal: str) -> None:
    import pyarrow.parquet as pq

    with open(journal, "w", encoding="utf-8") as f:
        for r in pq.read_table(parquet_path).to_pylist():
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
