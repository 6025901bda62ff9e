"""`pagedllm batch`: three input formats, per-row overrides, bad rows, resume after a kill, and outputs equal
to LLM.generate."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import assert_all_blocks_free
from pagedllm import LLM, SamplingParams
from pagedllm.batch.runner import run_batch

ROWS = [
    {"id": "a", "prompt": "def main():"},
    {"id": "b", "prompt": "import os", "max_tokens": 4},
    {"id": "c", "prompt": "class Foo:", "temperature": 0.0, "stop": "\n"},
    {"id": "bad-missing", "max_tokens": 3},
    {"id": "bad-param", "prompt": "x", "temperature": -1},
    {"id": "bad-long", "prompt": "x " * 600},
    {"id": "bad-n", "prompt": "x", "n": 2},  # a row's record holds one text
    {"id": "d", "prompt": "naïve café 東京"},
]
GOOD = ["a", "b", "c", "d"]


def write_input(path, rows):
    ext = os.path.splitext(path)[1]
    if ext == ".jsonl":
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    elif ext == ".csv":
        fields = sorted({k for r in rows for k in r})
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fields)
            w.writeheader()
            w.writerows(rows)
    else:
        keys = sorted({k for r in rows for k in r})
        pq.write_table(pa.table({k: [None if r.get(k) is None else str(r[k]) if k == "stop" else r.get(k)
                                     for r in rows] for k in keys}), path)


def read_output(path):
    if path.endswith(".parquet"):
        return {str(r["id"]): r for r in pq.read_table(path).to_pylist()}
    with open(path) as f:
        return {str(r["id"]): r for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20, max_num_seqs=4)


def expected(llm, row, defaults):
    params = SamplingParams(temperature=0, max_tokens=row.get("max_tokens", defaults.max_tokens),
                            stop=[row["stop"]] if "stop" in row else [])
    return llm.generate(row["prompt"], params, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("in_ext, out_ext", [(".jsonl", ".jsonl"), (".csv", ".parquet"), (".parquet", ".jsonl")])
def test_formats_overrides_bad_rows_and_equality_with_generate(llm, tmp_path, in_ext, out_ext):
    inp, out = str(tmp_path / f"in{in_ext}"), str(tmp_path / f"out{out_ext}")
    write_input(inp, ROWS)
    defaults = SamplingParams(temperature=0, max_tokens=12)
    summary = run_batch(llm, inp, out, defaults, show_progress=False)
    results = read_output(out)
    assert sorted(results) == sorted(r["id"] for r in ROWS)  # every row answered once
    for row in ROWS:
        res = results[row["id"]]
        if row["id"] in GOOD:
            want = expected(llm, row, defaults)
            assert res["text"] == want.text and res["num_output_tokens"] == len(want.token_ids)
            assert res["finish_reason"] == want.finish_reason and res.get("error") is None
        else:
            assert res["error"] and res.get("text") is None
    assert "prompt" in results["bad-missing"]["error"] and "temperature" in results["bad-param"]["error"]
    assert "max_model_len" in results["bad-long"]["error"] and "n must be 1" in results["bad-n"]["error"]
    assert results["b"]["num_output_tokens"] == 4  # the per-row override
    assert summary.requests == 8 and summary.errors == 4 and "requests: 8" in summary.line()
    assert_all_blocks_free(llm)


def test_resume_after_a_kill_writes_every_id_exactly_once(llama_dir, tmp_path):
    rows = [{"id": f"r{i}", "prompt": f"def f{i}(x):"} for i in range(120)]
    inp, out = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    write_input(inp, rows)
    cmd = [sys.executable, "-m", "pagedllm.cli", "batch", inp, out, "--model", llama_dir, "--dtype", "float32",
           "--max-model-len", "256", "--max-tokens", "48", "--max-num-seqs", "4", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(out) and sum(1 for _ in open(out)) >= 10:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = sum(1 for _ in open(out))
    assert 10 <= first < 120
    done = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{first} skipped" in done.stdout or f"{first - 1} skipped" in done.stdout
    ids = [json.loads(line)["id"] for line in open(out)]
    assert sorted(ids) == sorted(r["id"] for r in rows) and len(ids) == len(set(ids)) == 120
    assert "output tokens/s" in done.stdout
