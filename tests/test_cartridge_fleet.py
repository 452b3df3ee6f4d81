"""Cartridge fleets: the manifest, training under a RAM budget that evicts and reloads
(bit for bit what each document trained alone gives), and serving a cartridge per
request (server == Python API == CLI)."""
import json

import gguf
import pytest
import torch

import fucina
from fucina.errors import CartridgeError
from fucina.models import load_model
from fucina.models.cartridge import Cartridge
from fucina.models.cartridge_fleet import Fleet, Resident
from fucina.text.tokenizer import Tokenizer
from fucina.train.cartridge import SelfStudyConfig, train_cartridge
from fucina.train.cartridge_fleet import train_fleet
from synth import write_model

Q = gguf.GGMLQuantizationType
DOCS = {
    "plenn": "Zorvath is the capital of Plenn. The river Quiss flows through Zorvath. Its queen is Ilvara. " * 3,
    "skerry": "The lighthouse keeper on Skerry Point is called Morwenna and she owns nine cats. " * 3,
    "tarn": "Tarn Hollow grows violet barley; its mill was built in 1722 by the brothers Aske. " * 3,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("f") / "m.gguf", "qwen3", hidden=64, heads=4, kv_heads=2,
                       head_dim=32, layers=2, qtype=Q.F32)
    model = load_model(path)
    return path, model, Tokenizer.from_metadata(model.gguf.metadata)


def make_fleet(root, docs=DOCS, p=12):
    src = root / "src"
    src.mkdir(parents=True)
    fleet = Fleet.create(root / "fleet")
    for name, text in docs.items():
        (src / f"{name}.txt").write_text(text)
        fleet.add(name, str(src / f"{name}.txt"), p=p)
    return fleet


def captured_fleet(root, path, n_ctx):
    """A fleet of DOCS whose cartridges are each document's own first 16 rows (untrained:
    serving and retrieval tests need distinct cartridges, not good ones)."""
    fleet = make_fleet(root, p=16)
    llm = fucina.load(path, n_ctx=n_ctx)
    for e in fleet.entries:
        ids = llm.tokenize(fleet.corpus(e))[:e.p]
        Cartridge.capture(llm.model, ids, corpus=ids).save(fleet.path(e.file))
    return fleet, llm, {e.name: fleet.path(e.file) for e in fleet.entries}


def test_resident_evicts_the_least_recently_used():
    loaded, dropped = [], []
    r = Resident(25, lambda k: (loaded.append(k), k)[1], lambda v: 10, lambda k, v: dropped.append(k))
    r.get("a"), r.get("b"), r.get("a"), r.get("c")      # a is newer than b: b goes
    assert dropped == ["b"] and "a" in r and "c" in r
    r.get("b")
    assert dropped == ["b", "a"] and loaded == ["a", "b", "c", "b"]
    tight = Resident(1, lambda k: k, lambda v: 10)      # over budget: the newest stays alone
    tight.get("x"), tight.get("y")
    assert list(tight.items) == ["y"] and tight.evictions == 1


def test_manifest_add_list_and_refusals(tmp_path, capsys):
    from fucina.cli.main import main

    (tmp_path / "a.txt").write_text(DOCS["plenn"])
    (tmp_path / "b.txt").write_text(DOCS["skerry"])
    d = tmp_path / "fl"
    assert main(["cartridge", "fleet", "add", str(d), str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
                 "--p", "16"]) == 0
    capsys.readouterr()
    assert main(["cartridge", "fleet", "list", str(d), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["p"], r["seed"], r["file"]) for r in rows] == [("a", 16, 0, None), ("b", 16, 1, None)]
    assert (d / "a.txt").read_text() == DOCS["plenn"]      # documents from elsewhere are copied in
    fleet = Fleet.open(d)
    with pytest.raises(CartridgeError, match="already"):
        fleet.add("a", str(tmp_path / "a.txt"))
    with pytest.raises(CartridgeError, match="letters"):
        fleet.add("../x", str(tmp_path / "a.txt"))
    with pytest.raises(CartridgeError, match="no fleet"):
        Fleet.open(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CartridgeError, match="cannot read"):
        Fleet.open(tmp_path / "bad.json")


def test_training_under_a_tight_budget_is_each_document_trained_alone(tiny, tmp_path):
    """Budget 1 byte: one document resident, evicted to disk at every turn and reloaded;
    the cartridges equal a roomy run's and each document's own train_cartridge, bitwise."""
    _, model, tok = tiny
    cfg = SelfStudyConfig(conversations=4, accum=2, chunk_tokens=40, max_question=6, max_answer=6, batch=2)
    tight = make_fleet(tmp_path / "tight")
    roomy = make_fleet(tmp_path / "roomy")
    got = train_fleet(model, tok, tight, cfg, budget=1, turn=1)
    assert got["evictions"] >= 3 and got["loads"] == got["evictions"] + 1 and got["trained"] == {n: 4 for n in DOCS}
    assert train_fleet(model, tok, roomy, cfg, budget=1 << 30, turn=4)["evictions"] == 0
    assert Fleet.open(tmp_path / "tight" / "fleet").get("tarn").steps == 2
    for i, name in enumerate(DOCS):
        a = Cartridge.load(tight.path(tight.get(name).file))
        b = Cartridge.load(roomy.path(roomy.get(name).file))
        alone = train_cartridge(model, tok, DOCS[name], SelfStudyConfig(**vars(cfg) | {"p": 12, "seed": i, "batch": 1}))
        for x, y, z in zip(a.k + a.v, b.k + b.v, alone.k + alone.v):
            assert torch.equal(x, y) and torch.equal(x, z)
        assert a.meta["conversations"] == 4 and a.meta["steps"] == 2
    # more conversations later: the run resumes from the files
    more = train_fleet(model, tok, tight, SelfStudyConfig(**vars(cfg) | {"conversations": 6}), budget=1, turn=1,
                       names=["plenn"])
    assert more["trained"] == {"plenn": 6} and Fleet.open(tmp_path / "tight" / "fleet").get("skerry").conversations == 4


def test_serving_a_fleet_picks_a_cartridge_per_request(tiny, tmp_path, capsys):
    """server --fleet (by model name or the cartridge field) == the Python API behind that
    file == the CLI; one slot shared by requests for different cartridges; eviction."""
    from starlette.testclient import TestClient

    from fucina.cli.main import main
    from fucina.serve import Server
    from fucina.serve.app import create_app
    from fucina.text.cartridge import FleetPrefixes

    path, model, _ = tiny
    fleet = make_fleet(tmp_path, p=16)
    llm = fucina.load(path, n_ctx=256)
    for e in fleet.entries[:2]:                     # two trained (captured) cartridges, the third not
        ids = llm.tokenize(fleet.corpus(e))[:e.p]
        Cartridge.capture(llm.model, ids, corpus=ids).save(fleet.path(e.file))
    files = {e.name: fleet.path(e.file) for e in fleet.entries}

    def api(name, text="hello"):
        kw = {"cartridge": files[name]} if name else {}
        return fucina.load(path, n_ctx=256, **kw).chat(max_tokens=6, temperature=0).send(text)

    want = {"plenn": api("plenn"), "skerry": api("skerry"), None: api(None)}
    assert len(set(want.values())) > 1
    prefixes = FleetPrefixes(fleet.root, llm.model, budget=1)     # one resident at a time
    assert prefixes.names() == ["plenn", "skerry"]
    server = Server.from_llm(fucina.load(path, n_ctx=256), slots=1, fleet=prefixes)
    with TestClient(create_app(server)) as c:
        def ask(**kw):
            r = c.post("/v1/chat/completions", json={"max_tokens": 6, "temperature": 0, **kw,
                                                      "messages": [{"role": "user", "content": "hello"}]})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        for name in ("plenn", "skerry", "plenn", None, "skerry"):
            assert ask(model=name or "anything") == want[name]
        assert ask(model="x", cartridge="skerry") == want["skerry"]
        r = c.post("/v1/chat/completions", json={"model": "x", "cartridge": "tarn",
                                                  "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "tarn" in r.json()["error"]["message"]
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids[1:] == ["plenn", "skerry"]
    assert prefixes.resident.evictions >= 2
    out = tmp_path / "ids.txt"
    assert main(["run", path, "--tokens", "40,41,42", "--gen", "6", "--cartridge", files["skerry"],
                 "--ids-out", str(out)]) == 0
    capsys.readouterr()
    ref = fucina.load(path, n_ctx=256, cartridge=files["skerry"])
    ref.generate([40, 41, 42], max_tokens=6, temperature=0)
    assert [int(x) for x in out.read_text().split()] == ref.last.tokens


def test_cli_trains_a_fleet_and_a_single_cartridge_alike(tiny, tmp_path, capsys):
    from fucina.cli.main import main

    path, _, _ = tiny
    fleet = make_fleet(tmp_path, docs={"plenn": DOCS["plenn"]})
    opts = ["--conversations", "2", "--accum", "2", "--chunk", "40", "--max-question", "6", "--max-answer", "6",
            "--batch", "2", "-t", "1"]
    assert main(["cartridge", "fleet", "train", str(path), fleet.root, "--ram", "1", *opts]) == 0
    assert main(["cartridge", "train", str(path), "--corpus", str(tmp_path / "src" / "plenn.txt"), "--p", "12",
                 "--out", str(tmp_path / "one.safetensors"), *opts]) == 0
    assert "trained 1 cartridges" in capsys.readouterr().out
    a, b = Cartridge.load(fleet.path("plenn.safetensors")), Cartridge.load(tmp_path / "one.safetensors")
    assert all(torch.equal(x, y) for x, y in zip(a.k + a.v, b.k + b.v) if x is not None)
    assert main(["cartridge", "fleet", "list", fleet.root]) == 0
    assert "plenn" in capsys.readouterr().out


def test_retrieval_picks_composes_and_keeps_its_index(tiny, tmp_path, capsys):
    """A request naming no cartridge runs behind the one its text is closest to (a
    document's own text: that document, cosine 1), or the top two composed in manifest
    order, exactly as the Python API behind those files; every choice of n > 1 goes
    behind it; the saved index is reused, and rebuilt when a document changes."""
    from starlette.testclient import TestClient

    from fucina.cli.main import main
    from fucina.serve import Server
    from fucina.serve.app import create_app, query_text
    from fucina.text.cartridge import FleetPrefixes
    from fucina.text.retrieval import INDEX, FleetIndex, chunks_of, embed

    path, _, _ = tiny
    fleet, llm, files = captured_fleet(tmp_path, path, n_ctx=512)
    prefixes = FleetPrefixes(fleet.root, llm.model, tokenizer=llm.tokenizer, top_k=1)
    index = prefixes.build_index()
    assert index.names == list(DOCS) and (tmp_path / "fleet" / INDEX).exists()
    for name, text in DOCS.items():
        chunk = chunks_of(llm.tokenizer.encode(text, add_special=False, parse_special=False), 128)[-1]
        top = index.scores(embed(llm.model, chunk))        # one of its own chunks: cosine 1
        assert top[0][0] == name and top[0][1] == pytest.approx(1.0, abs=1e-5)
        assert index.pick(llm.model, llm.tokenizer, text, 1) == [name]
    two = index.pick(llm.model, llm.tokenizer, DOCS["tarn"], 2)
    assert "tarn" in two and two == [n for n in DOCS if n in two]       # manifest order
    assert chunks_of(range(300), 128) == [list(range(128)), list(range(128, 256)), list(range(256, 300))]
    assert chunks_of(range(270), 128) == [list(range(128)), list(range(128, 270))]   # a short tail joins

    def api(names, text):
        llm2 = fucina.load(path, n_ctx=512, cartridge=[files[n] for n in names])
        return llm2.chat(max_tokens=6, temperature=0).send(text)

    server = Server.from_llm(fucina.load(path, n_ctx=512), slots=1, fleet=prefixes)
    with TestClient(create_app(server)) as c:
        def ask(text, **kw):
            r = c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 6, "temperature": 0, **kw,
                                                      "messages": [{"role": "user", "content": text}]})
            assert r.status_code == 200, r.text
            return [ch["message"]["content"] for ch in r.json()["choices"]]
        assert ask(DOCS["skerry"]) == [api(["skerry"], DOCS["skerry"])] != [api(["plenn"], DOCS["skerry"])]
        assert ask(DOCS["plenn"], n=2) == [api(["plenn"], DOCS["plenn"])] * 2
        assert ask("hello", cartridge=["tarn", "plenn"]) == [api(["plenn", "tarn"], "hello")]
        prefixes.top_k = 2
        assert ask(DOCS["tarn"]) == [api(two, DOCS["tarn"])]
    assert query_text({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]},
                                    {"role": "assistant", "content": "b"}]}) == "a"
    assert query_text({"prompt": "c"}) == "c" and query_text({"input": "d"}) == "d"

    # the saved index is reused; an edited document makes it stale, and it is rebuilt
    mtime = (tmp_path / "fleet" / INDEX).stat().st_mtime_ns
    again = FleetPrefixes(fleet.root, llm.model, tokenizer=llm.tokenizer, top_k=1).build_index()
    assert (tmp_path / "fleet" / INDEX).stat().st_mtime_ns == mtime and torch.equal(again.vectors, index.vectors)
    with open(fleet.path(fleet.get("tarn").corpus), "w") as fh:
        fh.write("Tarn Hollow now grows only rye. " * 5)
    log = []
    FleetPrefixes(fleet.root, llm.model, tokenizer=llm.tokenizer, top_k=1).build_index(log=log.append)
    assert any("stale" in s for s in log)
    other = write_model(tmp_path / "other.gguf", "qwen3", hidden=64, heads=4, kv_heads=2, head_dim=32, layers=2,
                        qtype=Q.F32, seed=7)
    log.clear()
    FleetPrefixes(fleet.root, load_model(other), tokenizer=llm.tokenizer, top_k=1).build_index(log=log.append)
    assert any("stale" in s for s in log)       # same identity, other weights: the probe tells
    (tmp_path / "fleet" / INDEX).write_bytes(b"junk")
    with pytest.raises(CartridgeError, match="cannot read the fleet index"):
        FleetIndex.load(str(tmp_path / "fleet" / INDEX))

    assert main(["cartridge", "fleet", "query", str(path), fleet.root, DOCS["skerry"], "--json",
                 "--top-k", "2"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["scores"][0]["name"] == "skerry" and "skerry" in res["picked"] and len(res["picked"]) == 2


def test_fleet_training_with_distractors_does_not_depend_on_the_budget(tiny, tmp_path):
    """--distract in a fleet: each document trains beside the others' corpus-initialised
    rows; those are fixed, so one resident at a time still equals all resident."""
    _, model, tok = tiny
    docs = {k: DOCS[k] for k in ("plenn", "skerry")}
    cfg = SelfStudyConfig(conversations=2, accum=1, chunk_tokens=40, max_question=6, max_answer=6, batch=2,
                          distract=1.0)
    tight, roomy = make_fleet(tmp_path / "tight", docs), make_fleet(tmp_path / "roomy", docs)
    train_fleet(model, tok, tight, cfg, budget=1, turn=1)
    train_fleet(model, tok, roomy, cfg, budget=1 << 30, turn=2)
    plain = make_fleet(tmp_path / "plain", docs)
    train_fleet(model, tok, plain, SelfStudyConfig(**vars(cfg) | {"distract": 0.0}), budget=1 << 30)
    for name in docs:
        a, b, c = (Cartridge.load(f.path(f.get(name).file)) for f in (tight, roomy, plain))
        assert all(torch.equal(x, y) for x, y in zip(a.k + a.v, b.k + b.v))
        assert not all(torch.equal(x, y) for x, y in zip(a.k + a.v, c.k + c.v))


def test_cli_distractors_are_documents_first_rows_or_files(tiny, tmp_path, capsys):
    from fucina.cli.main import main

    path, model, tok = tiny
    (tmp_path / "a.txt").write_text(DOCS["plenn"])
    (tmp_path / "b.txt").write_text(DOCS["skerry"])
    opts = ["--conversations", "2", "--epochs", "1", "--accum", "1", "--chunk", "40", "--max-question", "6",
            "--max-answer", "6", "--batch", "2", "-t", "1", "--p", "12", "--distract", "1"]
    assert main(["cartridge", "train", str(path), "--corpus", str(tmp_path / "a.txt"), "--out",
                 str(tmp_path / "a.safetensors"), "--distractor", str(tmp_path / "b.txt"), *opts]) == 0
    other = Cartridge.capture(model, tok.encode(DOCS["skerry"], add_special=True, parse_special=False)[:12])
    other.save(tmp_path / "b.safetensors")
    assert main(["cartridge", "train", str(path), "--corpus", str(tmp_path / "a.txt"), "--out",
                 str(tmp_path / "a2.safetensors"), "--distractor", str(tmp_path / "b.safetensors"), *opts]) == 0
    cfg = SelfStudyConfig(p=12, conversations=2, epochs=1, accum=1, chunk_tokens=40, max_question=6, max_answer=6,
                          batch=2, distract=1.0, scaled=True, turns=4, spread=True, lr=1e-2)
    want = train_cartridge(model, tok, DOCS["plenn"], cfg, distractors=[other])
    for f in ("a.safetensors", "a2.safetensors"):
        got = Cartridge.load(tmp_path / f)
        assert all(torch.equal(x, y) for x, y in zip(got.k + got.v, want.k + want.v))
    with pytest.raises(SystemExit):
        main(["cartridge", "train", str(path), "--corpus", str(tmp_path / "a.txt"), "--out",
              str(tmp_path / "x.safetensors"), "--distract", "1.5"])
    capsys.readouterr()


def test_python_api_and_chat_retrieve_from_a_fleet(tiny, tmp_path, capsys):
    """fucina.load(fleet=DIR): generate() retrieves per call, a conversation once, from its
    first message (later turns stay behind those rows), as the files behind them answer;
    `fucina chat --fleet` the same."""
    from fucina.cli.main import main
    from fucina.errors import InvalidArgument

    path, _, _ = tiny
    fleet, llm, files = captured_fleet(tmp_path, path, n_ctx=1024)

    def behind(name):
        return fucina.load(path, n_ctx=1024, cartridge=files[name])

    rag = fucina.load(path, n_ctx=1024, fleet=fleet.root)
    for name in ("skerry", "tarn", "skerry"):
        got = rag.generate(DOCS[name], max_tokens=6, temperature=0)
        assert got == behind(name).generate(DOCS[name], max_tokens=6, temperature=0)
        assert rag._history[:16] == rag.fleet.prefix(name).ids      # the cache holds that cartridge's rows
    conv, ref = rag.chat(max_tokens=6, temperature=0), behind("plenn").chat(max_tokens=6, temperature=0)
    assert [conv.send(DOCS["plenn"]), conv.send(DOCS["tarn"])] == [ref.send(DOCS["plenn"]), ref.send(DOCS["tarn"])]
    conv.reset()                                   # a fresh conversation retrieves again
    assert conv.send(DOCS["tarn"]) == behind("tarn").chat(max_tokens=6, temperature=0).send(DOCS["tarn"])
    with pytest.raises(InvalidArgument, match="not both"):
        fucina.load(path, cartridge=files["tarn"], fleet=fleet.root)

    want = behind("skerry").chat(max_tokens=6, temperature=0).send(DOCS["skerry"])
    capsys.readouterr()
    assert main(["chat", str(path), DOCS["skerry"], "--fleet", fleet.root, "--gen", "6", "--temp", "0",
                 "-c", "1024"]) == 0
    assert want.strip() in capsys.readouterr().out
