"""Structured output: with the random tiny model sampling at temperature 1, the grammar alone makes outputs valid.
Every constrained output that ends by itself parses and validates (JSON schema), fully matches (regex), is a
choice, or derives from the grammar; free requests in the same batch are unaffected; invalid specs are refused
by name; speculative decoding leaves constrained requests alone."""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import pytest

from conftest import assert_all_blocks_free
from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 1 << 25, "max_num_seqs": 32}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}
REGEX = r"[a-z]{2,5}-\d{1,3}(\.\d)?"
CHOICES = ["red", "green", "blue", "dark blue", "a.b (c)?"]
GRAMMAR = 'root ::= "(" num tail? tail? tail? ")"\ntail ::= op num\nop ::= "+" | "*"\nnum ::= [1-9] [0-9]?'
GRAMMAR_RE = r"\([1-9][0-9]?([+*][1-9][0-9]?){0,3}\)"


def _json(text: str):
    """Parsed JSON. strict=False admits raw control characters inside strings: xgrammar 0.2.9's rule for a
    length-bounded string (maxLength) lets them through, where RFC 8259 wants them escaped; everything else
    about the text is checked."""
    return json.loads(text, strict=False)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, **ENGINE)


def _sampled(llm, spec, n, seed0=0, prompts=("def main():", "import os", "x = 1\n", "class A:")):
    params = [SamplingParams(temperature=1.0, seed=seed0 + i, max_tokens=96, structured_outputs=spec)
              for i in range(n)]
    return [o.outputs[0] for o in llm.generate([prompts[i % len(prompts)] for i in range(n)], params, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_two_hundred_sampled_outputs_all_follow_their_constraint(llm, backend):
    b = {"backend": backend}
    outs = {"json": _sampled(llm, {"json": SCHEMA, **b}, 60), "regex": _sampled(llm, {"regex": REGEX, **b}, 50, 100),
            "choice": _sampled(llm, {"choice": CHOICES, **b}, 50, 200),
            "grammar": _sampled(llm, {"grammar": GRAMMAR, **b}, 40, 300)}
    assert sum(map(len, outs.values())) == 200
    for kind, items in outs.items():  # every one ended by the grammar (EOS), none cut by max_tokens
        assert Counter(o.finish_reason for o in items) == {"stop": len(items)}, (kind, [o.text for o in items])
    for o in outs["json"]:
        jsonschema.validate(_json(o.text), SCHEMA)
    # re.ASCII: \d is an ASCII digit in both engines (as in JSON Schema's patterns)
    assert all(re.fullmatch(REGEX, o.text, re.ASCII) for o in outs["regex"]), [o.text for o in outs["regex"]]
    assert all(o.text in CHOICES for o in outs["choice"])
    assert len({o.text for o in outs["choice"]}) >= 2  # sampled, not a fixed answer
    assert all(re.fullmatch(GRAMMAR_RE, o.text) for o in outs["grammar"]), [o.text for o in outs["grammar"]]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_json_object_outputs_that_end_are_objects(llm, backend):
    outs = _sampled(llm, {"json_object": True, "backend": backend}, 24, 400)
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done
    assert all(isinstance(_json(o.text), dict) for o in done)


def test_a_mixed_batch_leaves_the_free_requests_as_they_were(llm):
    prompts = ["def f(x):", "import sys", "for i in range(3):", "print("]
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=5, max_tokens=24, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], free, use_tqdm=False)]
    constrained = [SamplingParams(temperature=1.0, seed=9, max_tokens=64, structured_outputs={"regex": REGEX}),
                   SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json": SCHEMA})]
    mixed = llm.generate(prompts, free + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert re.fullmatch(REGEX, mixed[2].outputs[0].text)
    jsonschema.validate(_json(mixed[3].outputs[0].text), SCHEMA)


def test_preemption_keeps_the_grammar_state(llama_dir):
    """A budget of a few blocks forces recomputes mid-output; the outputs still follow their grammar and
    equal the unpreempted ones."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs={"json": SCHEMA})
              for i in range(6)]
    prompts = ["x" * 60 + str(i) for i in range(6)]
    short = {**ENGINE, "max_model_len": 128}
    roomy = LLM(llama_dir, **short).generate(prompts, params, use_tqdm=False)
    block_bytes = 2 * 2 * 2 * 32 * 16 * 4  # layers x (K, V) x KV heads x head_dim x block size x fp32
    tight = LLM(llama_dir, **{**short, "kv_cache_memory_bytes": 10 * block_bytes})  # 6 requests need ~30
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.get_stats().num_preemptions > 0
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in roomy]
    for o in outs:
        jsonschema.validate(_json(o.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("spec, message", [
    ({"json": '{"type": "objectx"}'}, "structured_outputs.json: Invalid type: objectx (guidance)"),
    ({"json": '{"type": "objectx"}', "backend": "xgrammar"}, "structured_outputs.json: Unsupported type"),
    ({"json": "{not json"}, "structured_outputs.json: not valid JSON"),
    ({"regex": "a(b"}, "structured_outputs.regex: invalid regex \"a(b\" (in regex): regex parse error: unclosed group"),
    ({"regex": "a(b", "backend": "xgrammar"}, "structured_outputs.regex: Regex parsing error"),
    ({"grammar": 'root ::= "a'}, "structured_outputs.grammar: Failed to convert the grammar from GBNF"),
    ({"grammar": "root ::= ", "backend": "xgrammar"}, "structured_outputs.grammar: EBNF parser error"),
    # keywords llguidance cannot enforce are refused (xgrammar would take them by ignoring them)
    ({"json": {"type": "array", "uniqueItems": True}}, 'Unimplemented keys: ["uniqueItems"]'),
    ({"json": "false"}, "structured_outputs.json: the schema false matches nothing"),
    ({"regex": "a", "backend": "outlines"}, "structured_outputs.backend: must be one of auto, guidance, xgrammar"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"choice": []}, "structured_outputs.choice: must be a non-empty list"),
    ({"choice": ["ok", 3]}, "structured_outputs.choice"),
])
def test_invalid_specs_are_refused_naming_the_problem(llm, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate("x", SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_combinations_that_cannot_end_are_refused():
    with pytest.raises(ValueError, match="ignore_eos: cannot be combined"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(ValueError, match="min_tokens: cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})


def test_grammars_compile_once_per_spec_and_backend(llm):
    compiler = llm.engine.input_processor
    a = compiler.compile_grammar(SamplingParams(structured_outputs={"json": SCHEMA}))
    b = compiler.compile_grammar(SamplingParams(structured_outputs={"json": json.dumps(SCHEMA)}))
    assert a is b and a.backend == "guidance"  # the same schema as a dict or as text is one cache entry
    c = compiler.compile_grammar(SamplingParams(structured_outputs={"json": SCHEMA, "backend": "xgrammar"}))
    assert c.backend == "xgrammar" and c is compiler.compile_grammar(
        SamplingParams(structured_outputs={"json": SCHEMA, "backend": "xgrammar"}))


def test_schemas_differing_in_property_order_are_two_grammars(llm):
    compiler = llm.engine.input_processor
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    ba = {**ab, "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    first, second = (compiler.compile_grammar(SamplingParams(structured_outputs={"json": s})) for s in (ab, ba))
    assert first is not second
    out = llm.generate("x", SamplingParams(temperature=0, max_tokens=32, structured_outputs={"json": ba}),
                       use_tqdm=False)[0].outputs[0].text
    assert out.startswith('{"b":'), out  # properties are generated in the schema's order


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"secret": {"type": "string", "format": "password", "maxLength": 8},
                                      "blob": {"type": "string", "format": "binary", "maxLength": 8}},
     "required": ["secret", "blob"], "additionalProperties": False},  # what Pydantic writes for SecretStr, bytes
    "true",  # any JSON value
])
def test_annotation_formats_and_the_true_schema_are_taken(llm, schema):
    outs = _sampled(llm, {"json": schema}, 8, 500)
    for o in outs:
        if o.finish_reason == "stop":
            value = _json(o.text)
            if schema != "true":
                jsonschema.validate(value, schema)


def test_a_matcher_failing_mid_output_fails_its_request_alone(llm):
    """llguidance's matcher can fail mid-output (a parser resource limit); the mask fill then raises, and that
    request alone finishes with the error while the others complete."""
    engine = llm.engine
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=48, structured_outputs={"json": SCHEMA})
    ids = [engine.add_request(p, params) for p in ("a", "b", "c")]
    engine.step()
    victim = engine.scheduler.requests[ids[1]]

    def broken(bitmask, row):
        raise ValueError("structured output: parser too complex")

    victim.grammar.matcher.fill = broken
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[ids[1]].outputs[0].finish_reason == "error" and "parser too complex" in done[ids[1]].error
    for rid in (ids[0], ids[2]):
        assert done[rid].outputs[0].finish_reason in ("stop", "length")
    assert_all_blocks_free(llm)


def test_auto_takes_xgrammars_own_ebnf_to_xgrammar(llm):
    """A grammar in xgrammar's extensions to GBNF (TagDispatch) that llguidance cannot read compiles with
    xgrammar under auto; the request runs."""
    spec = {"grammar": 'root ::= TagDispatch(("<a>", b))\nb ::= "x"'}
    assert llm.engine.input_processor.compile_grammar(SamplingParams(structured_outputs=spec)).backend == "xgrammar"
    out = llm.generate("x", SamplingParams(max_tokens=8, structured_outputs=spec), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason in ("stop", "length")
    assert_all_blocks_free(llm)


def test_the_engine_default_backend_is_a_setting(llama_dir):
    llm = LLM(llama_dir, **ENGINE, structured_outputs_backend="xgrammar")
    params = SamplingParams(temperature=0, max_tokens=16, structured_outputs={"regex": REGEX})
    assert llm.engine.input_processor.compile_grammar(params).backend == "xgrammar"
    assert re.fullmatch(REGEX, llm.generate("x", params, use_tqdm=False)[0].outputs[0].text)
    with pytest.raises(ValueError, match="structured_outputs_backend: must be one of auto, guidance, xgrammar"):
        LLM(llama_dir, **ENGINE, structured_outputs_backend="outlines")


def test_speculation_skips_constrained_requests(llama_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(llama_dir, **ENGINE, speculative_config=spec)
    prompt = "ab-12 ab-12 ab-12 ab-12 ab-"  # a prompt the n-gram proposer would draft from
    outs = llm.generate([prompt] * 4, [SamplingParams(temperature=0, max_tokens=32,
                                                      structured_outputs={"regex": REGEX})] * 4, use_tqdm=False)
    assert all(re.fullmatch(REGEX, o.outputs[0].text) for o in outs)
    assert llm.get_stats().spec_decode_num_draft_tokens == 0


def test_a_tokenizer_llguidance_cannot_read_leaves_auto_on_xgrammar(llm, monkeypatch):
    """Where llguidance refuses the tokenizer (it reads only `tokenizers`-backed ones), auto compiles with
    xgrammar and an explicit guidance request is refused with the reason."""
    from pagedllm.engine.structured_output import compiler as module

    def unreadable(*args):
        raise ValueError("llguidance cannot use this tokenizer (TypeError: slow tokenizer)")

    monkeypatch.setitem(module._MAKERS, "guidance", unreadable)
    info = llm.engine.model_info
    grammars = module.GrammarCompiler(llm.engine.tokenizer, info.vocab_size, info.eos_token_ids)
    assert grammars.compile(StructuredOutputsParams(regex=REGEX)).backend == "xgrammar"
    with pytest.raises(ValueError, match=r"structured_outputs.regex: llguidance cannot use this tokenizer .*\(guidance\)"):
        grammars.compile(StructuredOutputsParams(regex=REGEX, backend="guidance"))
