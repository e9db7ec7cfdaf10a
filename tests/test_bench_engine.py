"""eyas bench --engine against real loopback HTTP servers that speak the SGLang / vLLM subset the bench uses, backed
by a tiny random Llama decoded with eyas's own speculative and plain decoders: the counters the servers report are
real, so the engine bench must reproduce the in-process bench's tau exactly. Plus each bad input: a server that does
not decode speculatively, a wrong served model name, a timeout, a server killed mid-run, two different models."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from support.models import make_tiny_llama
from support.models import byte_tokenizer

from eyas.bench.bench import BenchConfig, prompt_ids, prompt_room, run_bench
from eyas.bench.engine import EngineBenchConfig, open_tokenizer, run_engine_bench
from eyas.cli import main as cli_main
from eyas.decode.spec import SpecConfig, SpecDecoder, SpecStats
from eyas.errors import EyasError
from eyas.model.dflash import DFlashConfig, DFlashDrafter
from eyas.model.drafter import DrafterConfig, Eagle3Drafter
from eyas.target import target_from_model
from eyas.target.runner import Runner


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models on one thread


@pytest.fixture(scope="module")
def tiny_served(tmp_path_factory):
    """(target, drafter, weightless target dir: config + generation config + tokenizer)."""
    model = make_tiny_llama(vocab=258, seed=31)
    model.config.eos_token_id = 257
    model.generation_config.eos_token_id = 257
    tok = byte_tokenizer()
    target = target_from_model(model, tok, name="tiny", aux_layer_ids=(1, 2, 3))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target(model.config, draft_vocab_size=258, aux_layer_ids=(1, 2, 3)))
    d = tmp_path_factory.mktemp("served")
    model.config.save_pretrained(d)
    model.generation_config.save_pretrained(d)
    tok.save_pretrained(d)
    return target, drafter.eval(), str(d)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    lines = [{"prompt": "hello there"}, {"turns": ["one", "two, again"]}, {"prompt": "x" * 300},
             {"prompt": "abcabcabcabc"}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(p)


def bench_cfg(prompts, target_dir, **kw):
    return BenchConfig(target=target_dir, prompts=prompts, k=3, max_new_tokens=12, max_seq=160, **kw)


class Engine:
    """A loopback server with the endpoints bench --engine reads: SGLang's /generate, /get_model_info,
    /get_server_info and /v1/models; vLLM's /v1/completions, /v1/models, /version and /metrics. It decodes with
    `decode(ids, n, eos) -> (tokens, SpecStats)` and reports the stats as the engine does: SGLang per reply
    (spec_verify_ct, spec_correct_drafts_histogram), vLLM as Prometheus counters.

    speculative: the server says it decodes speculatively (SGLang's speculative_algorithm, vLLM's spec metrics);
    algorithm: SGLang's speculative_algorithm (EAGLE3, DFLASH); counters=False drops SGLang's per-reply counters; die_after: the server shuts down (connection refused from
    then on) after that many replies; delay: seconds each reply waits."""

    lock = threading.Lock()  # every server decodes on the one runner: a timed-out request still decodes after

    def __init__(self, engine, decode, *, speculative, served="tiny", model_path="/models/tiny", counters=True,
                 die_after=None, delay=0.0, logprobs=None, algorithm="EAGLE3"):
        self.engine, self.decode, self.speculative, self.logprobs = engine, decode, speculative, logprobs
        self.algorithm = algorithm  # SGLang's speculative_algorithm; its DFLASH forces num_steps to 1
        self.served, self.model_path, self.counters = served, model_path, counters
        self.die_after, self.delay = die_after, delay
        self.replies, self.drafts, self.per_pos, self.bodies = 0, 0, [], []
        owner = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, payload):
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                code, payload = owner.get(self.path)
                self._send(code, payload)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                code, payload = owner.post(self.path, body)
                if owner.die_after is not None and owner.replies >= owner.die_after:
                    owner.srv.shutdown()          # this reply still goes out; the next connection is refused
                    owner.srv.server_close()
                try:
                    self._send(code, payload)
                except OSError:
                    pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def close(self):
        try:
            self.srv.shutdown()
            self.srv.server_close()
        except OSError:
            pass

    def get(self, path):
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.served, "root": self.model_path}]}
        if self.engine == "sglang" and path == "/get_model_info":
            return 200, {"model_path": self.model_path, "is_generation": True}
        if self.engine == "sglang" and path == "/get_server_info":
            return 200, {"version": "0.5.14-fake", "model_path": self.model_path, "dtype": "float32",
                         "speculative_algorithm": self.algorithm if self.speculative else None,
                         "speculative_num_steps": 1 if self.algorithm == "DFLASH" else 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
                         "speculative_draft_model_path": "/models/drafter" if self.speculative else None}
        if self.engine == "vllm" and path == "/version":
            return 200, {"version": "0.25.0-fake"}
        if self.engine == "vllm" and path == "/metrics":
            lines = ["# TYPE vllm:generation_tokens counter", f'vllm:generation_tokens_total{{engine="0"}} 1.0']
            if self.speculative:
                lines += ["# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.",
                          f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="{self.served}"}} {self.drafts}.0']
                lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="{self.served}",'
                          f'position="{j}"}} {c}.0' for j, c in enumerate(self.per_pos)]
            return 200, "\n".join(lines) + "\n"
        return 404, {"detail": "Not Found"}

    def post(self, path, body):
        self.bodies.append(body)
        time.sleep(self.delay)
        if self.engine == "sglang" and path == "/generate":
            ids, n, eos = body["input_ids"], body["sampling_params"]["max_new_tokens"], body["sampling_params"].get("stop_token_ids")
        elif self.engine == "vllm" and path == "/v1/completions":
            if body["model"] != self.served:
                return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}
            ids, n, eos = body["prompt"], body["max_tokens"], body.get("stop_token_ids")
        else:
            return 404, {"detail": "Not Found"}
        k = body.get("top_logprobs_num") if self.engine == "sglang" and body.get("return_logprob") else body.get("logprobs")
        if k:   # one step with the next token's top-k log-probabilities, in each engine's reply format
            if self.logprobs is None:
                return 400, {"error": {"message": "logprobs are not served here"}}
            with self.lock:
                top = self.logprobs(ids).topk(k)
            pairs = list(zip(top.values.tolist(), top.indices.tolist()))
            if self.engine == "sglang":
                return 200, {"text": "", "output_ids": [pairs[0][1]],
                             "meta_info": {"output_top_logprobs": [[[v, i, None] for v, i in pairs]]}}
            return 200, {"choices": [{"text": "", "token_ids": [pairs[0][1]],
                                      "logprobs": {"top_logprobs": [{f"token_id:{i}": v for v, i in pairs}]}}]}
        with self.lock:
            out, st = self.decode(ids, n, eos)
            self.replies += 1
            self.drafts += st.rounds
            self.per_pos += [0] * (len(st.accepted_at) - len(self.per_pos))
            for j, a in enumerate(st.accepted_at):
                self.per_pos[j] += a
        if self.engine == "vllm":
            return 200, {"choices": [{"text": "", "token_ids": out}],
                         "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)}}
        meta = {"completion_tokens": len(out), "prompt_tokens": len(ids)}
        if self.speculative and self.counters and st.rounds:
            hist = [0] * (max(st.accepted) + 1)
            for a in st.accepted:
                hist[a] += 1
            meta.update(spec_verify_ct=st.rounds, spec_correct_drafts_histogram=hist)
        return 200, {"text": "", "output_ids": out, "meta_info": meta}


@pytest.fixture(scope="module")
def decoders(tiny_served):
    """The servers' models on one runner of the tiny target: the bench's EAGLE-3 chain (its random drafter accepts
    nothing), prompt lookup (accepts some: tau > 1), both with k = 3, and plain greedy decoding."""
    target, drafter, _ = tiny_served
    runner = Runner.from_hf(target.model, max_batch=1, max_seq=160, device="cpu")
    decs = {"eagle-chain": SpecDecoder(runner, drafter, SpecConfig(method="chain", k=3)),
            "lookup": SpecDecoder(runner, None, SpecConfig(method="lookup", k=3))}

    def spec(name):
        return lambda ids, n, eos: decs[name].generate(ids, n, eos_ids=eos)

    def plain(ids, n, eos):
        out = runner.generate([ids], n, temperature=0.0, eos_ids=eos, window=0)[0]
        return out, SpecStats(tokens=len(out), target_forwards=len(out))

    return spec, plain


@pytest.fixture
def servers(decoders):
    made = []

    def make(engine, spec=True, decoder="eagle-chain", **kw):
        e = Engine(engine, decoders[0](decoder) if spec else decoders[1], speculative=spec, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture(scope="module")
def in_process(tiny_served, prompts):
    target, drafter, d = tiny_served
    return run_bench(bench_cfg(prompts, d, lossless_turns=0), target=target, drafter=drafter)


def test_weightless_dir_gives_the_targets_tokenizer_and_eos(tiny_served):
    target, _, d = tiny_served
    tok, eos = open_tokenizer(d)
    msgs = [{"role": "user", "content": "hello there"}]
    assert eos == target.eos_token_ids == [257]
    assert prompt_ids(tok, msgs, 100) == prompt_ids(target.tokenizer, msgs, 100)


@pytest.mark.parametrize("engine,concurrency,decoder", [
    ("sglang", 1, "eagle-chain"), ("vllm", 1, "eagle-chain"), ("sglang", 1, "lookup"), ("vllm", 1, "lookup"),
    ("sglang", 2, "lookup"), ("vllm", 2, "lookup")])
def test_engine_tau_is_the_in_process_tau(tiny_served, prompts, in_process, servers, tmp_path, capsys, engine, concurrency,
                                          decoder):
    """The same model and decoder behind the servers as in the in-process bench's method: the engine bench's tau
    (from the engine's counters), tokens, target forwards and acceptance by position equal that method's exactly;
    the speedup is the ratio of the two servers' tok/s; the greedy replies of the two servers agree on every turn;
    the prompts went as ids."""
    _, _, d = tiny_served
    spec, plain = servers(engine, decoder=decoder), servers(engine, spec=False)
    out = tmp_path / "engine.json"
    rep = run_engine_bench(bench_cfg(prompts, d, json_out=str(out)),
                           EngineBenchConfig(engine=engine, url=spec.url, plain_url=plain.url, concurrency=concurrency))
    ours, ref = rep["methods"]["eagle-chain"], in_process["methods"][decoder]
    for key in ("tau", "tokens", "target_forwards", "rounds", "acceptance_by_position"):
        assert ours[key] == ref[key], key
    assert len(ours["acceptance_by_position"]) == 3 and (ours["tau"] > 1.2 if decoder == "lookup" else True)
    if engine == "sglang" or concurrency == 1:  # vLLM's counters are server-wide: per record only at batch 1
        assert ours["per_record"] == ref["per_record"] and ours["tau_ci95"] == ref["tau_ci95"]
    assert rep["methods"]["plain"]["tokens"] == in_process["methods"]["plain"]["tokens"]
    assert rep["methods"]["plain"]["tau"] == 1.0
    # the report's seconds are rounded to 0.1 ms and the speedup to 3 decimals: equal up to that rounding
    tps = {k: m["tokens"] / m["seconds"] for k, m in rep["methods"].items()}
    assert ours["speedup"] == pytest.approx(tps["eagle-chain"] / tps["plain"], rel=5e-3, abs=1e-3)
    ag = rep["agreement"]["eagle-chain"]
    assert ag["identical_turns"] == ag["turns"] == 5
    assert (rep["records"], rep["turns"], rep["truncated"]) == (4, 5, 1) == (
        in_process["records"], in_process["turns"], in_process["truncated"])
    eng = rep["engine"]
    assert eng["spec"]["version"].endswith("-fake") and eng["spec"]["served_model"] == "tiny"
    assert eng["plain"]["url"] == plain.url and eng["spec"]["speculative"] is not None
    written = json.loads(out.read_text())
    assert written["methods"]["eagle-chain"]["tau"] == ours["tau"] and out.with_suffix(".png").exists()
    # the last record's request carried the ids of the in-process bench's prompt and its eos ids (with two records
    # in flight, it need not be the last request)
    sent = {tuple(b["input_ids"] if engine == "sglang" else b["prompt"]): b for b in spec.bodies}
    room = prompt_room(bench_cfg(prompts, d))
    body = sent[tuple(prompt_ids(tiny_served[0].tokenizer, [{"role": "user", "content": "abcabcabcabc"}], room)[0])]
    assert (body["sampling_params"]["stop_token_ids"] if engine == "sglang" else body["stop_token_ids"]) == [257]
    assert "eagle-chain" in capsys.readouterr().out


def test_cli_engine_bench_and_one_line_errors(tiny_served, prompts, servers, tmp_path, capsys):
    """Through `eyas bench --engine`: a report JSON; a wrong served model name is one line naming what is served,
    exit 2, no JSON."""
    _, _, d = tiny_served
    spec, plain = servers("sglang"), servers("sglang", spec=False)
    out = tmp_path / "cli.json"
    base = ["bench", "--engine", "sglang", "--url", spec.url, "--target", d, "--prompts", prompts, "--chain", "3",
            "--max-new-tokens", "12", "--max-seq", "160", "--json", str(out)]
    assert cli_main(base + ["--plain-url", plain.url]) == 0
    assert json.loads(out.read_text())["methods"]["eagle-chain"]["speedup"] > 0
    out.unlink()
    capsys.readouterr()
    assert cli_main(base + ["--model", "kimi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "serves 'tiny', not 'kimi' (--model)" in err and not out.exists()
    assert cli_main(["bench", "--url", spec.url, "--target", d]) == 2
    assert "--engine sglang or vllm" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_server_that_does_not_decode_speculatively_is_refused(tiny_served, prompts, servers, engine):
    _, _, d = tiny_served
    plain = servers(engine, spec=False)
    with pytest.raises(EyasError, match=r"--url .* does not decode speculatively"):
        run_engine_bench(bench_cfg(prompts, d), EngineBenchConfig(engine=engine, url=plain.url))
    spec = servers(engine)
    with pytest.raises(EyasError, match=r"--plain-url .* decodes speculatively"):
        run_engine_bench(bench_cfg(prompts, d), EngineBenchConfig(engine=engine, url=spec.url, plain_url=spec.url))


def test_sglang_replies_without_counters_are_refused(tiny_served, prompts, servers):
    """A server that says it is speculative but sends no spec_verify_ct: refused at its first reply, not a tau."""
    _, _, d = tiny_served
    bare = servers("sglang", counters=False)
    with pytest.raises(EyasError, match=r"no meta_info.spec_verify_ct .*warm-up"):
        run_engine_bench(bench_cfg(prompts, d), EngineBenchConfig(engine="sglang", url=bare.url))


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_wrong_model_name_and_two_different_models(tiny_served, prompts, servers, engine):
    _, _, d = tiny_served
    spec = servers(engine)
    with pytest.raises(EyasError, match=r"serves 'tiny', not 'other' \(--model\)"):
        run_engine_bench(bench_cfg(prompts, d), EngineBenchConfig(engine=engine, url=spec.url, model="other"))
    other = servers(engine, spec=False, served="tiny", model_path="/models/another")
    with pytest.raises(EyasError, match=r"--url serves '/models/tiny' but --plain-url serves '/models/another'"):
        run_engine_bench(bench_cfg(prompts, d), EngineBenchConfig(engine=engine, url=spec.url, plain_url=other.url))


def test_request_timeout(tiny_served, prompts, servers):
    _, _, d = tiny_served
    slow = servers("sglang", delay=1.5)
    with pytest.raises(EyasError, match=r"no answer within 0.3 s \(--request-timeout\)"):
        run_engine_bench(bench_cfg(prompts, d), EngineBenchConfig(engine="sglang", url=slow.url, request_timeout=0.3))


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_server_that_dies_mid_run(tiny_served, prompts, servers, tmp_path, engine):
    """Killed after its third reply (the warm-up and two timed turns): one line saying the connection was refused
    and how many replies finished; no report file."""
    _, _, d = tiny_served
    plain, spec = servers(engine, spec=False), servers(engine, die_after=3)
    out = tmp_path / "r.json"
    with pytest.raises(EyasError, match=r"connection refused .*; 2 of 5 replies had finished, no report written"):
        run_engine_bench(bench_cfg(prompts, d, json_out=str(out)),
                         EngineBenchConfig(engine=engine, url=spec.url, plain_url=plain.url))
    assert not out.exists()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_differing_replies_get_the_plain_servers_margins(tiny_served, prompts, decoders, servers, engine, capsys):
    """A speculative server whose replies leave plain greedy at a known position (record 0: its third token becomes
    the second likeliest; record 3: its second token the tenth likeliest): the report names each record's first
    differing turn and position, and the margin is the plain server's log-probability gap there, equal to a naive
    reference forward over the prompt and the common prefix; a drafted token outside the top 5 has no margin."""
    target, _, d = tiny_served
    model, spec_decode = target.model, decoders[0]("eagle-chain")

    def logprobs(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)

    flips = {}   # prompt ids -> (position, rank of the token put there)

    def diverging(ids, n, eos):
        out, st = spec_decode(ids, n, eos)
        if tuple(ids) in flips:
            j, rank = flips[tuple(ids)]
            out = out[:j] + [logprobs(ids + out[:j]).topk(rank + 1).indices[rank].item()] + out[j + 1:]
        return out, st

    cfg = bench_cfg(prompts, d)
    room = prompt_room(cfg)
    tok = target.tokenizer
    first = [prompt_ids(tok, [{"role": "user", "content": t}], room)[0] for t in ("hello there", "abcabcabcabc")]
    flips[tuple(first[0])], flips[tuple(first[1])] = (2, 1), (1, 9)
    spec = Engine(engine, diverging, speculative=True)
    plain = servers(engine, spec=False, logprobs=logprobs)
    try:
        rep = run_engine_bench(cfg, EngineBenchConfig(engine=engine, url=spec.url, plain_url=plain.url))
    finally:
        spec.close()
    ag = rep["agreement"]["eagle-chain"]
    assert ag["identical_turns"] == 3
    div = {r["record"]: r for r in ag["divergences"]}
    assert sorted(div) == [0, 3] and div[0]["turn"] == div[3]["turn"] == 0
    assert (div[0]["position"], div[3]["position"]) == (2, 1)
    ref = logprobs(first[0] + decoders[1](first[0], 2, [])[0][:2])   # naive: the prompt and plain's first 2 tokens
    assert div[0]["plain"] == ref.argmax().item() and div[0]["spec"] == ref.topk(2).indices[1].item()
    assert div[0]["margin"] == pytest.approx((ref.max() - ref.topk(2).values[1]).item(), abs=1e-4)
    assert div[3]["margin"] is None and div[3]["spec_logprob"] is None and div[3]["plain_logprob"] is not None
    line = capsys.readouterr().out
    assert "eagle-chain first differing tokens: 2 turn(s)" in line and "1 drafted token(s) outside" in line


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_served_dflash_drafter_is_benched_as_dflash(tiny_served, prompts, tmp_path, engine):
    """A DFlash drafter of block 4 behind the servers (SGLang says DFLASH with 4 draft tokens; vLLM says nothing, so
    --drafter-kind dflash): the report's method is dflash, with the in-process DFlash bench's tau, counts and
    acceptance at each of the block's 3 draft slots; a kind that contradicts SGLang's algorithm is refused."""
    target, _, d = tiny_served
    torch.manual_seed(3)
    cfg = DFlashConfig.from_target(target.model.config, aux_layer_ids=(1, 2, 3), mask_token_id=256, num_layers=1,
                                   block_size=4)
    dflash = DFlashDrafter(cfg)
    dflash.init_weights(0.3)
    dflash.eval()
    ref = run_bench(bench_cfg(prompts, d, lossless_turns=0, baselines=False), target=target,
                    drafter=dflash)["methods"]["dflash"]
    runner = Runner.from_hf(target.model, max_batch=1, max_seq=160, device="cpu")
    dec = SpecDecoder(runner, dflash, SpecConfig(method="chain", k=3))
    srv = Engine(engine, lambda ids, n, eos: dec.generate(ids, n, eos_ids=eos), speculative=True, algorithm="DFLASH")
    try:
        kind = "dflash" if engine == "vllm" else None
        rep = run_engine_bench(bench_cfg(prompts, d), EngineBenchConfig(engine=engine, url=srv.url,
                                                                         drafter_kind=kind))
        ours = rep["methods"]["dflash"]
        for key in ("tau", "tokens", "target_forwards", "rounds", "acceptance_by_position"):
            assert ours[key] == ref[key], key
        assert len(ours["acceptance_by_position"]) == 3
        if engine == "sglang":
            with pytest.raises(EyasError, match="--drafter-kind eagle3, but the server at --url serves 'DFLASH'"):
                run_engine_bench(bench_cfg(prompts, d), EngineBenchConfig(engine=engine, url=srv.url,
                                                                          drafter_kind="eagle3"))
    finally:
        srv.close()


def test_engine_bench_config_refuses_an_unknown_drafter_kind_and_engine():
    """Both of the config's checks run: the drafter family and the engine name."""
    with pytest.raises(EyasError, match="--drafter-kind 'medusa': expected eagle3 or dflash"):
        EngineBenchConfig(engine="vllm", url="http://127.0.0.1:1", drafter_kind="medusa")
    with pytest.raises(EyasError, match="engine 'trt': expected sglang or vllm"):
        EngineBenchConfig(engine="trt", url="http://127.0.0.1:1", drafter_kind="dflash")
