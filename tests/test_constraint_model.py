"""Structured output on the real SmolLM2 at temperature 0.8: every output parses and
validates, through the Python API (every schema; a seed of its own, two on the first eight), the CLI, and the
server with the official clients (OpenAI chat incl. `.parse` with pydantic, Responses,
Anthropic, llama.cpp body fields), streamed and not; forced tool calls carry valid
arguments in all three dialects."""
from __future__ import annotations

import json
import re

import pytest

from constraint_schemas import REGEXES, SCHEMAS
from fucina.errors import SchemaWarning

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

HOT = dict(temperature=0.8)
FORMATS = jsonschema.FormatChecker()


def valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    import fucina.kernels as kernels
    from fucina.text.api import load

    before = kernels.get_threads()
    kernels.set_threads(1)
    yield load(smollm2_path, n_ctx=1024)
    kernels.set_threads(before)


# -- Python API: the whole schema set ----------------------------------------------------

@pytest.mark.parametrize("name", list(SCHEMAS))
def test_api_every_schema_validates(llm, name):
    schema = SCHEMAS[name]
    base = list(SCHEMAS).index(name)
    for seed in (base, base + 100)[:2 if base < 8 else 1]:     # two seeds on the first eight
        chat = llm.chat(json_schema=schema, seed=seed, **HOT)
        out = chat.send("Reply in JSON.", max_tokens=96)
        assert chat.last.finish_reason == "stop", (name, seed, out)
        valid(out, schema)


def test_api_regex_fullmatch_and_pydantic(llm):
    pydantic = pytest.importorskip("pydantic")
    for i, rx in enumerate(REGEXES):
        for seed in (i, i + 7):
            out = llm.generate("Answer:", max_tokens=24, regex=rx, seed=seed, **HOT)
            assert re.fullmatch(rx, out), (rx, out)

    class Pet(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")   # bounded: no open extra keys
        name: str = pydantic.Field(max_length=12)
        legs: int = pydantic.Field(ge=0, le=8)

    out = "".join(llm.chat(json_schema=Pet, seed=3, **HOT).stream("Describe a pet.", max_tokens=60))
    assert Pet.model_validate_json(out).legs <= 8


# -- CLI ---------------------------------------------------------------------------------

def test_cli_flags(smollm2_path, tmp_path, capsys):
    from fucina.cli.main import main

    schema = SCHEMAS["nested_object"]
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMAS["defs_ref"]))
    g = tmp_path / "g.gbnf"
    g.write_text('root ::= ("yes" | "no") "!"')
    common = [str(smollm2_path), "--temp", "0.8", "-t", "1", "--gen", "96"]
    runs = [(["--json-schema", json.dumps(schema), "--seed", "1"], lambda o: valid(o, schema)),
            (["--json-schema", "@" + str(f), "--seed", "2"], lambda o: valid(o, SCHEMAS["defs_ref"])),
            (["--grammar", "@" + str(g), "--seed", "3"], lambda o: re.fullmatch("(yes|no)!", o) or 1 / 0)]
    for extra, check in runs:
        assert main(["chat", *common[:1], "Reply.", *common[1:], *extra]) == 0
        check(capsys.readouterr().out.strip())
    assert main(["run", str(smollm2_path), "-p", "Colour:", "--regex", " (red|blue)", "--temp", "0.8",
                 "-t", "1", "-n", "8"]) == 0
    assert re.fullmatch("Colour: (red|blue)", capsys.readouterr().out.strip())
    unique = ('{"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4, '
              '"uniqueItems": true}')
    assert main(["chat", str(smollm2_path), "x", "--json-schema", unique, "--strict"]) == 1
    assert "uniqueItems" in capsys.readouterr().err
    with pytest.warns(SchemaWarning, match="uniqueItems"):       # lenient: the rest is enforced
        assert main(["chat", *common[:1], "Numbers.", *common[1:], "--json-schema", unique, "--seed", "4"]) == 0
    out = json.loads(capsys.readouterr().out.strip())
    assert isinstance(out, list) and len(out) <= 4 and all(isinstance(v, int) for v in out)


# -- server ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(llm):
    from fucina.serve import Server
    from test_serve import live

    with live(Server.from_llm(llm, slots=2, batch=2)) as url:
        yield url


def test_server_openai_response_formats(server):
    from test_serve import oai
    pydantic = pytest.importorskip("pydantic")
    c = oai(server)
    msgs = [{"role": "user", "content": "Reply in JSON."}]

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=16)
        country: str = pydantic.Field(max_length=16)
        population: int = pydantic.Field(ge=0, le=40_000_000)

    for seed in (1, 2):
        r = c.chat.completions.parse(model="x", messages=[{"role": "user", "content": "Describe Paris."}],
                                     response_format=City, seed=seed, max_tokens=80, **HOT)
        assert isinstance(r.choices[0].message.parsed, City)
    for i, name in enumerate(("one_of", "format_date_time", "array_of_objects", "optional_fields")):
        schema = SCHEMAS[name]
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        r = c.chat.completions.create(model="x", messages=msgs, response_format=fmt, seed=i, max_tokens=96, **HOT)
        valid(r.choices[0].message.content, schema)
        chunks = c.chat.completions.create(model="x", messages=msgs, response_format=fmt, seed=i + 10,
                                           max_tokens=96, stream=True, **HOT)
        valid("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), schema)
    # any JSON object is unbounded (sampled strings may run past max_tokens): every reply
    # that finished must parse, and some seed finishes
    finished = 0
    for seed in range(4, 8):
        r = c.chat.completions.create(model="x", messages=msgs, response_format={"type": "json_object"},
                                      seed=seed, max_tokens=128, **HOT)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
            finished += 1
    assert finished >= 1
    parsed = c.responses.parse(model="x", input="Describe Paris.", text_format=City, max_output_tokens=80,
                               **HOT)
    assert isinstance(parsed.output_parsed, City) and parsed.text.format.type == "json_schema"
    schema = SCHEMAS["integer_range"]
    resp = c.responses.create(model="x", input="Reply in JSON.", max_output_tokens=96, **HOT,
                              text={"format": {"type": "json_schema", "name": "r", "schema": schema}})
    valid(resp.output_text, schema)


def test_server_llamacpp_fields_and_errors(server):
    import httpx
    msgs = [{"role": "user", "content": "Answer."}]
    url = server + "/v1/chat/completions"
    schema = SCHEMAS["enum"]
    r = httpx.post(url, json={"messages": msgs, "json_schema": schema, "temperature": 0.8, "max_tokens": 40},
                   timeout=60).json()
    valid(r["choices"][0]["message"]["content"], schema)
    r = httpx.post(url, json={"messages": msgs, "grammar": 'root ::= "A" [0-9]', "temperature": 0.8,
                              "max_tokens": 8}, timeout=60).json()
    assert re.fullmatch("A[0-9]", r["choices"][0]["message"]["content"])
    r = httpx.post(server + "/v1/completions", json={"prompt": "x", "json_schema": schema, "max_tokens": 40},
                   timeout=60).json()
    valid(r["choices"][0]["text"], schema)
    bad = [(url, {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
               "name": "n", "strict": True, "schema": {"type": "object", "not": {}}}}}, "not"),
           (url, {"messages": msgs, "grammar": "root ::= nowhere"}, "nowhere"),
           (url, {"messages": msgs, "response_format": {"type": "xml"}}, "json_schema"),
           (server + "/v1/responses", {"input": "x", "text": {"format": {
               "type": "json_schema", "name": "n", "strict": True, "schema": {"if": {}, "then": {}}}}}, "if")]
    for u, body, word in bad:
        r = httpx.post(u, json=body, timeout=60)
        assert r.status_code == 400 and word in r.json()["error"]["message"], (body, r.text)
    unique = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
              "maxItems": 4, "uniqueItems": True}
    for body in ({"json_schema": unique},                  # llama.cpp's field has no strict: lenient
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": unique}}}):
        r = httpx.post(url, json={"messages": msgs, "temperature": 0.8, "max_tokens": 40, **body}, timeout=60)
        assert r.status_code == 200, r.text
        out = json.loads(r.json()["choices"][0]["message"]["content"])
        assert isinstance(out, list) and len(out) <= 4


TOOL_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": TOOL_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {
                                               "type": "string", "maxLength": 20}}, "required": ["city"]}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_server_forced_tool_calls_openai(server):
    from test_serve import oai
    c = oai(server)
    for i, choice in enumerate(("required", {"type": "function", "function": {"name": "get_time"}})):
        kw = dict(model="x", messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                  max_tokens=192, seed=i, **HOT)   # sampled args may run long
        ch = c.chat.completions.create(**kw).choices[0]
        assert ch.finish_reason == "tool_calls"
        call = ch.message.tool_calls[0].function
        valid(call.arguments, PARAMS[call.name])
        if isinstance(choice, dict):
            assert call.name == "get_time"
        args, names = {}, {}
        for chunk in c.chat.completions.create(**kw, stream=True):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                args[tc.index] = args.get(tc.index, "") + (tc.function.arguments or "")
                names[tc.index] = tc.function.name or names.get(tc.index)
        assert args and all(valid(a, PARAMS[names[k]]) is None for k, a in args.items())
    resp = c.responses.create(model="x", input="Weather in Rome?", max_output_tokens=192,
                              extra_body={"seed": 0},   # sampled args may run long; a fixed draw
                              tools=[{"type": "function", "name": "get_weather", "parameters": TOOL_PARAMS}],
                              tool_choice="required", parallel_tool_calls=False, **HOT)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert calls and valid(calls[0].arguments, TOOL_PARAMS) is None
    done = [e for e in c.responses.create(model="x", input="Weather in Rome?", max_output_tokens=64, stream=True,
                                          extra_body={"seed": 1},   # a fixed draw, as above
                                          tools=[{"type": "function", "name": "get_weather",
                                                  "parameters": TOOL_PARAMS}],
                                          tool_choice={"type": "function", "name": "get_weather"}, **HOT)
            if e.type == "response.function_call_arguments.done"]
    assert done and valid(done[0].arguments, TOOL_PARAMS) is None


def test_server_forced_tool_calls_anthropic(server):
    from test_serve import anth
    a = anth(server)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}):
        m = a.messages.create(model="x", max_tokens=64, messages=ASK, tools=tools, tool_choice=choice)
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses
        jsonschema.validate(uses[0].input, PARAMS[uses[0].name])
        with a.messages.stream(model="x", max_tokens=64, messages=ASK, tools=tools, tool_choice=choice) as s:
            final = s.get_final_message()
        uses = [b for b in final.content if b.type == "tool_use"]
        assert uses and jsonschema.validate(uses[0].input, PARAMS[uses[0].name]) is None


def test_server_batch_keeps_one_constraint_per_stream(server):
    """Concurrent requests decode in one lockstep batch (batch=2), each under its own
    grammar (or none)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    url = server + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "Answer."}]
    jobs = [({"json_schema": SCHEMAS["const"]}, lambda t: valid(t, SCHEMAS["const"])),
            ({"grammar": 'root ::= "B" [0-9] [0-9]'}, lambda t: re.fullmatch("B[0-9]{2}", t) or 1 / 0),
            ({"json_schema": SCHEMAS["nested_arrays"]}, lambda t: valid(t, SCHEMAS["nested_arrays"])),
            ({}, lambda t: None)]

    def one(job):
        body = {"messages": msgs, "temperature": 0.8, "max_tokens": 40, **job[0]}
        return httpx.post(url, json=body, timeout=120).json()["choices"][0]["message"]["content"]
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(one, jobs))
    for (_, check), out in zip(jobs, outs):
        check(out)


def test_scripted_think_then_forced_call_passes_the_grammar_unchanged(llm):
    """A scripted model (test_serve) that thinks, then writes a hermes call: under
    tool_choice "required" the grammar (free think block, then a call valid for the
    tool) admits every token it forces, so the reply is exactly the unconstrained one."""
    from test_serve import ASK as WEATHER, live, oai, scripted_server

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "kelvin"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
    with live(scripted_server(llm)) as url:
        c = oai(url)
        for stream in (False, True):
            kw = dict(model="x", messages=WEATHER, tools=[tool], tool_choice="required", max_tokens=80,
                      temperature=0.8, parallel_tool_calls=False)
            if not stream:
                msg = c.chat.completions.create(**kw).choices[0].message
                reasoning, args = msg.reasoning_content, msg.tool_calls[0].function.arguments
            else:
                reasoning, args = "", ""
                for ch in c.chat.completions.create(**kw, stream=True):
                    d = ch.choices[0].delta if ch.choices else None
                    reasoning += (getattr(d, "reasoning_content", None) or "") if d else ""
                    args += "".join(t.function.arguments or "" for t in (d.tool_calls or [])) if d else ""
            assert "call the tool" in reasoning
            assert json.loads(args) == {"city": "Paris", "unit": "celsius"}
