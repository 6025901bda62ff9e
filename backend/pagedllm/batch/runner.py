"""`pagedllm batch`: run a file of prompts through the engine with continuous batching.

Rows are fed as the engine has room (a bounded number in flight, so a huge file never sits in memory), each
finished request is written at once, bad rows become error records, and `resume` skips ids already written.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from tqdm import tqdm

from pagedllm.batch.files import ResultWriter, read_rows
from pagedllm.llm import LLM
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@dataclass
class BatchSummary:
    requests: int = 0
    errors: int = 0
    skipped: int = 0
    output_tokens: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        tps = self.output_tokens / self.seconds if self.seconds else 0.0
        return (f"requests: {self.requests} ({self.errors} errors, {self.skipped} skipped as already done), "
                f"output tokens: {self.output_tokens}, {self.seconds:.1f} s, {tps:.1f} output tokens/s")


def run_batch(llm: LLM, input_path: str, output_path: str, defaults: SamplingParams | None = None,
              prompt_field: str = "prompt", id_field: str = "id", resume: bool = False,
              show_progress: bool = True) -> BatchSummary:
    defaults = defaults or SamplingParams()
    engine = llm.engine
    writer = ResultWriter(output_path, resume)
    summary = BatchSummary()
    max_in_flight = 2 * engine.config.scheduler.max_num_seqs
    in_flight: dict[str, str] = {}  # engine request id -> row id
    bar = tqdm(desc="batch", unit="tok", disable=not show_progress)
    t0 = time.perf_counter()
    rows = enumerate(read_rows(input_path))
    exhausted = False
    try:
        while not exhausted or in_flight:
            while not exhausted and len(in_flight) < max_in_flight:
                try:
                    index, row = next(rows)
                except StopIteration:
                    exhausted = True
                    break
                row_id = str(row.get(id_field, index))
                if row_id in writer.done_ids:
                    summary.skipped += 1
                    continue
                summary.requests += 1
                try:
                    prompt, params = _row_request(row, prompt_field, defaults)
                    params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                    in_flight[engine.add_request(prompt, params)] = row_id
                except (ValueError, TypeError) as e:
                    summary.errors += 1
                    writer.write({"id": row_id, "error": str(e)})
            if not in_flight:
                continue
            for out in engine.step():
                if not out.finished:
                    continue
                row_id = in_flight.pop(out.request_id)
                c = out.outputs[0]
                if out.error is not None:  # this row failed alone: an error record, the others go on
                    summary.errors += 1
                    writer.write({"id": row_id, "error": out.error})
                    continue
                writer.write({"id": row_id, "text": c.text, "num_prompt_tokens": len(out.prompt_token_ids),
                              "num_output_tokens": len(c.token_ids), "finish_reason": c.finish_reason})
                summary.output_tokens += len(c.token_ids)
                bar.update(len(c.token_ids))
                bar.set_postfix(requests=summary.requests - len(in_flight) - summary.errors)
    finally:
        for rid in list(in_flight):  # interrupted: nothing half-done is written; --resume redoes these
            engine.abort_request(rid)
        bar.close()
        summary.seconds = time.perf_counter() - t0
    writer.close()
    return summary


def _row_request(row: dict, prompt_field: str, defaults: SamplingParams) -> tuple[str, SamplingParams]:
    if "__error__" in row:
        raise ValueError(row["__error__"])
    prompt = row.get(prompt_field)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"{prompt_field}: missing or not a non-empty string")
    overrides = {k: _coerce(k, v) for k, v in row.items() if k in _PARAM_FIELDS}
    params = dataclasses.replace(defaults, **overrides) if overrides else defaults
    if params.n != 1:  # a row's record holds one text; best_of and beam_width still choose it
        raise ValueError(f"n: a batch row yields one text, so n must be 1 (got {params.n!r}); best_of and "
                         "beam_width pick the best one")
    return prompt, params


def _coerce(name: str, value):
    """CSV cells arrive as strings: give them the type of the SamplingParams field."""
    if not isinstance(value, str):
        return value
    default = getattr(SamplingParams(), name)
    if name == "stop":
        return [value]
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    if isinstance(default, float):
        return float(value)
    if isinstance(default, int) or default is None:
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}: expected an integer, got {value!r}") from None
    return value
