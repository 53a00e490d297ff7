"""Issue 38 items 1 and 3 on vLLM's `/collective_rpc` route: no weight route without authority, and a
refused update that leaves the engine serving.

The engine and the bridge are started with docs/trl.md's server-mode lines **as printed** (only CKPT,
MODEL_DIR, the ports and `$KEY` replaced). Before (ee7c2bc): the printed vLLM line had no `--host`, so
vLLM bound 0.0.0.0, and `/collective_rpc` loaded any readable safetensors file for any caller
(answering differently for files that do not exist); a file the bridge did not push, loaded with the
bridge's current version, kept the bridge `in_sync`; an update the worker refused (int32, wrong
shape, unknown name, NaN) got 502 and took the engine out of service (503 on health and rollouts).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("vllm")

from foursight.trainer_bridge.launch import free_port, wait_http_ok  # noqa: E402
from helpers.logprobs import server_prompt_logprobs  # noqa: E402
from helpers.weights import perturbed_state  # noqa: E402

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[1]
SEQS = [[5, 9, 13, 17, 21, 25, 29, 33], [40, 41, 42, 43, 44, 45]]


def doc_engine_lines(page: str = "docs/trl.md") -> list[str]:
    """The shell lines of the page's block marked ``<!-- engine lines: ... -->`` (continuations joined)."""
    text = (ROOT / page).read_text()
    block = text[text.index("<!-- engine lines:"):]
    block = block[block.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def listening_addresses(port: int) -> set[str]:
    """The local IPv4/IPv6 addresses with a socket LISTENing on ``port`` (from /proc/net/tcp*)."""
    out = set()
    for f, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        if not os.path.exists(f):
            continue
        for line in Path(f).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state != "0A" or int(p, 16) != port:
                continue
            if v6:
                out.add("::" if int(addr, 16) == 0 else ("::1" if addr.endswith("01000000") and int(addr[:24], 16) == 0 else addr))
            else:
                out.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return out


class DocLines:
    """Run a docs page's engine lines (``<!-- engine lines: -->`` block) with bash, as printed: the first
    ``export`` line gives the shared token, every other line is started as a server (placeholders
    replaced by ``sub``, whole words only) and waited for on its port."""

    def __init__(self, page: str, sub: dict[str, str], tmp: Path):
        self.lines = doc_engine_lines(page)
        self.sub, self.tmp, self.procs = sub, tmp, []
        self.env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "KEY": "k-test"}
        for k in ("FOURSIGHT_WEIGHTS_TOKEN", "FOURSIGHT_WEIGHTS_DIR", "VLLM_ENABLE_V1_MULTIPROCESSING"):
            self.env.pop(k, None)
        export = next(ln for ln in self.lines if ln.startswith("export "))
        self.token = subprocess.run(["bash", "-c", f"{export}\necho \"$FOURSIGHT_WEIGHTS_TOKEN\""], env=self.env, capture_output=True,
                                    text=True, check=True).stdout.strip()
        assert len(self.token) >= 32
        self.env["FOURSIGHT_WEIGHTS_TOKEN"] = self.token

    def fill(self, line: str) -> str:
        pat = "|".join(re.escape(k) for k in sorted(self.sub, key=len, reverse=True))
        return re.sub(rf"(?<![\w/]){pat}(?![\w])", lambda m: self.sub[m.group(0)], line)

    def line(self, start: str, contains: str = "") -> str:
        return next(ln for ln in self.lines if ln.startswith(start) and contains in ln)

    def start(self, line: str, port_word: str, name: str, timeout_s: float = 400, health: str = "/health") -> tuple[str, int]:
        """Start ``line`` with a free port put for its placeholder ``port_word`` (picked now, not before the
        servers started earlier, which may have taken it meanwhile); its URL and port once healthy."""
        port = free_port()
        self.sub[port_word] = str(port)
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen(["bash", "-c", self.fill(line)], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                               start_new_session=True, cwd=self.tmp))
        wait_http_ok(f"http://127.0.0.1:{port}{health}", timeout_s, self.procs[-1], what=f"{name} line", log_path=log)
        return f"http://127.0.0.1:{port}", port

    def stop(self) -> None:
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


@pytest.fixture(scope="module")
def docs_server(tiny_ckpt, tiny_llama_dir, tmp_path_factory):
    """docs/trl.md's export, engine and bridge lines run by bash as printed."""
    run = DocLines("docs/trl.md", {"CKPT": shlex.quote(str(tiny_ckpt)), "MODEL_DIR": shlex.quote(str(tiny_llama_dir))},
                   tmp_path_factory.mktemp("docs-trl"))
    try:
        engine, p_engine = run.start(run.line("VLLM_SERVER_DEV_MODE=1 foursight serve"), "8000", "engine")
        bridge, _ = run.start(run.line("foursight bridge serve"), "8100", "bridge", 120, "/health?probe=false")
        yield {"engine": engine, "bridge": bridge, "engine_port": p_engine, "token": run.token, "key": "k-test"}
    finally:
        run.stop()


def dev(token: str) -> dict:
    """The header that lets a call through the engine's guard of its dev routes (``foursight serve`` mounts it)."""
    from foursight.schema import WEIGHTS_TOKEN_HEADER

    return {WEIGHTS_TOKEN_HEADER: token}


def _rpc(server: dict, path, version: int, **kwargs) -> httpx.Response:
    """``foursight_update_weights`` through ``/collective_rpc`` past the route guard (``kwargs``: the worker's own)."""
    return httpx.post(server["engine"] + "/collective_rpc", headers=dev(server["token"]),
                      json={"method": "foursight_update_weights", "args": [str(path), str(version)],
                                                     "kwargs": kwargs}, timeout=300)


def _state(server: dict) -> dict:
    r = httpx.post(server["engine"] + "/collective_rpc", headers=dev(server["token"]), json={"method": "foursight_engine_state"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["results"][0]


def _shm_file(name: str, tensors: dict) -> Path:
    from foursight.trainer_bridge.protocol import shm_path

    p = Path(shm_path(f"foursight-test-{os.getpid()}-{name}.safetensors"))
    save_file(tensors, str(p))
    return p


def test_weight_update_through_the_bridge_requantizes_in_vllm(docs_server, tiny_ckpt, tiny_llama_dir):
    """End to end on docs/trl.md's lines (FourSight checkpoint, worker extension): ``POST /v1/weights``
    re-quantizes new BF16 weights inside vLLM; the rollouts after it carry the new version and their
    logprobs are those of the FourSight reference model re-quantized from the same new weights (the
    stale reference explains them far worse). First in this module: it needs the engine at version 0."""
    from foursight.hf import load_reference_model
    from foursight.trainer_bridge.client import RolloutClient
    from foursight.trainer_bridge.scoring import pad_rollouts, score
    from helpers.weights import reference_with_weights

    prompts = [[5, 6, 7, 8], [11, 12, 13]]
    sp = {"max_tokens": 16, "seed": 9, "temperature": 1.0}
    state = perturbed_state(tiny_llama_dir)
    f = _shm_file("requant", state)
    try:
        with RolloutClient(docs_server["bridge"], api_key=docs_server["key"]) as c:
            old = c.generate(prompts, sp, n=2)
            assert {r.weight_version for r in old} == {0}
            ack = c.update_weights(version=3, shm_name=f.name)
            assert ack["version"] == 3 and ack["engines"][0]["version"] == 3
            new = c.generate(prompts, sp, n=2)
            assert {r.weight_version for r in new} == {3}
            assert c.health()["weight_version"] == 3
    finally:
        f.unlink(missing_ok=True)
    ref_old = load_reference_model(tiny_ckpt)
    lt, lr, m = pad_rollouts(old, score(ref_old, old))
    err_v0 = float((lt - lr)[m].abs().mean())
    ref_new = reference_with_weights(tiny_ckpt, state)
    lt, lr, m = pad_rollouts(new, score(ref_new, new))
    err_new = float((lt - lr)[m].abs().mean())
    lt_stale, _, _ = pad_rollouts(new, score(ref_old, new))
    err_stale = float((lt_stale - lr)[m].abs().mean())
    print(f"\nFourSight vLLM vs FourSight HF reference: mean|r| v0={err_v0:.4f}, after update={err_new:.4f}, "
          f"stale reference={err_stale:.4f}")
    # W4A4 makes engine-vs-reference noise larger than BF16's (a tiny input difference can flip an FP4
    # code); measured on 2 cores: v0 0.12, after the update 0.25, stale 1.97. The new-weights reference must explain the engine far better than the stale one.
    assert err_v0 < 0.5 and err_new < 0.5
    assert err_stale > 4 * err_new


def test_documented_engine_binds_loopback_and_refuses_updates_without_the_token(docs_server, tiny_llama_dir, tmp_path):
    """The engine line as printed listens on 127.0.0.1 only; /collective_rpc's update refuses a call
    without the token, with a wrong one, and (with the token) any file outside the weights folder, in one
    answer whatever the file (no existence oracle); nothing loads and the version stays."""
    url = docs_server["engine"]
    assert listening_addresses(docs_server["engine_port"]) == {"127.0.0.1"}
    before = server_prompt_logprobs(url, SEQS)
    v0 = _state(docs_server)["version"]
    outside = tmp_path / "outside.safetensors"  # a real, valid update the engine can read, outside its folder
    save_file(perturbed_state(tiny_llama_dir, seed=5), str(outside))
    inside = _shm_file("inside", perturbed_state(tiny_llama_dir, seed=5))
    try:
        answers = {
            "no token": _rpc(docs_server, inside, v0),
            "wrong token": _rpc(docs_server, inside, v0, token="not-" + docs_server["token"]),
            "outside, exists": _rpc(docs_server, outside, v0, token=docs_server["token"]),
            "outside, missing": _rpc(docs_server, tmp_path / "missing.safetensors", v0, token=docs_server["token"]),
            "system file": _rpc(docs_server, "/etc/hostname", v0, token=docs_server["token"]),
        }
        for what, r in answers.items():
            assert r.status_code != 200, what
            assert "FourSight refused the weight update, nothing loaded" in r.text, (what, r.text[:300])
            assert str(tmp_path) not in r.text and "/etc" not in r.text, (what, r.text[:300])
        tails = {what: r.text[r.text.index("FourSight refused"):][:200] for what, r in answers.items() if what.startswith(("outside", "system"))}
        assert len(set(tails.values())) == 1, tails  # one answer: the route tells nothing about the engine's files
        httpx.post(url + "/reset_prefix_cache", headers=dev(docs_server["token"]), json={}, timeout=60)
        assert _state(docs_server)["version"] == v0
        assert all(torch.equal(a, b) for a, b in zip(server_prompt_logprobs(url, SEQS), before))
        # the engine is still alive and takes the same file with the token
        r = _rpc(docs_server, inside, v0 + 1000, token=docs_server["token"], weights_id="test")
        assert r.status_code == 200, r.text
        st = _state(docs_server)
        assert st["version"] == v0 + 1000 and st["weights_id"] == "test"
    finally:
        inside.unlink(missing_ok=True)


def test_a_bridge_of_the_wrong_engine_kind_is_one_line_naming_the_engine(docs_server):
    """``foursight bridge serve --engine sglang`` in front of this vLLM server: the CLI checks the engine
    before serving, so the user reads one error naming the URL and the route that failed, exit 2, and no
    traceback (it was a 30-line server traceback and uvicorn's exit 3)."""
    port = free_port()
    r = subprocess.run([str(Path(sys.executable).parent / "foursight"), "bridge", "serve", "--engine", "sglang", "--engine-url",
                        docs_server["engine"], "--port", str(port), "--wait", "30"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "FOURSIGHT_BRIDGE_API_KEY": ""})
    print(r.stderr[-600:])
    assert r.returncode == 2
    assert docs_server["engine"] in r.stderr and "/get_model_info -> 404" in r.stderr and "error:" not in r.stdout
    assert "Traceback" not in r.stderr + r.stdout and "Application startup failed" not in r.stderr


def test_bridge_goes_stale_on_weights_it_did_not_push(docs_server, tiny_llama_dir):
    """A push through the bridge, then a load the bridge did not make that sets the bridge's own version
    (with the token: another trainer): health 503 naming the weights id, rollouts 503; a new push brings it back."""
    from foursight.trainer_bridge.client import BridgeHTTPError, RolloutClient

    url, token = docs_server["engine"], docs_server["token"]
    f1 = _shm_file("push1", perturbed_state(tiny_llama_dir, seed=11))
    f2 = _shm_file("other", perturbed_state(tiny_llama_dir, seed=12))
    try:
        with RolloutClient(docs_server["bridge"], api_key=docs_server["key"]) as c:
            v = c.weight_version() + 1
            c.update_weights(version=v, shm_name=f1.name)
            assert c.health()["engines"][0]["sync"] == "in_sync"
            r = _rpc(docs_server, f2, v, token=token)  # same version, weights the bridge never pushed
            assert r.status_code == 200, r.text
            h = httpx.get(docs_server["bridge"] + "/v1/health?probe=false", timeout=60)
            assert h.status_code == 503 and h.json()["engines"][0]["sync"] == "stale", h.text
            assert "did not push" in h.json()["engines"][0]["reason"]
            with pytest.raises(BridgeHTTPError) as ei:
                c.generate([[5, 6, 7]], {"max_tokens": 2, "temperature": 0.0})
            assert ei.value.status == 503
            c.update_weights(version=v + 1, shm_name=f1.name)
            assert c.health()["engines"][0]["sync"] == "in_sync"
    finally:
        f1.unlink(missing_ok=True)
        f2.unlink(missing_ok=True)


@pytest.mark.parametrize("bad", ["int32", "shape", "unknown", "nan"])
def test_a_refused_vllm_update_is_422_and_the_engine_stays_in_service(docs_server, tiny_llama_dir, bad):
    """An update the worker refuses before loading (int32 norm, wrong shape, unknown name; NaN is caught by
    the bridge's own check) is 422 naming engine and tensor; health stays 200 in sync, rollouts answer,
    the logprobs are bit-identical and the version unchanged."""
    from foursight.trainer_bridge.client import BridgeHTTPError, RolloutClient

    good = load_file(str(Path(tiny_llama_dir) / "model.safetensors"))
    name = {"int32": "model.norm.weight", "shape": "model.layers.1.mlp.down_proj.weight",
            "unknown": "model.layers.1.mlp.no_such_proj.weight", "nan": "model.norm.weight"}[bad]
    upd = dict(good)
    if bad == "int32":
        upd[name] = torch.ones_like(good[name], dtype=torch.int32)
    elif bad == "shape":
        upd[name] = good[name][:, :-1].contiguous()
    elif bad == "unknown":
        upd[name] = torch.zeros(4, 4, dtype=torch.bfloat16)
    else:
        upd[name] = good[name].clone()
        upd[name][0] = float("nan")
    f = _shm_file(f"bad-{bad}", upd)
    url = docs_server["engine"]
    try:
        with RolloutClient(docs_server["bridge"], api_key=docs_server["key"]) as c:
            v = c.weight_version()
            before = server_prompt_logprobs(url, SEQS)
            with pytest.raises(BridgeHTTPError) as ei:
                c.update_weights(version=v + 1, shm_name=f.name)
            assert ei.value.status == 422, str(ei.value)
            assert name in str(ei.value) and (bad == "nan" or "vllm@" in str(ei.value)), str(ei.value)
            h = httpx.get(docs_server["bridge"] + "/v1/health", timeout=120)
            assert h.status_code == 200 and h.json()["engines"][0]["sync"] == "in_sync", h.text
            assert c.weight_version() == v
            out = c.generate([[5, 6, 7]], {"max_tokens": 2, "temperature": 0.0})
            assert out[0].weight_version == v
        assert all(torch.equal(a, b) for a, b in zip(server_prompt_logprobs(url, SEQS), before))
    finally:
        f.unlink(missing_ok=True)


# ---- docs/bridge.md's engine lines, as printed ----

@pytest.fixture(scope="module")
def bridge_md(tiny_llama_dir, tiny_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs-bridge")
    policy = tmp / "policy"
    policy.mkdir()
    run = DocLines("docs/bridge.md", {"MODEL": shlex.quote(str(tiny_llama_dir)), "CKPT": shlex.quote(str(tiny_ckpt)),
                                      "/shared/policy": shlex.quote(str(policy))}, tmp)
    try:
        engine, p_engine = run.start(run.line("FOURSIGHT_WEIGHTS_DIR="), "8000", "engine")
        bridge, _ = run.start(run.line("foursight bridge serve", "--engine vllm"), "8100", "bridge", 120, "/health?probe=false")
        yield {"run": run, "engine": engine, "bridge": bridge, "engine_port": p_engine, "policy": policy, "key": "k-test"}
    finally:
        run.stop()


def test_bridge_page_lines_run_as_printed_and_its_filter_keeps_sequences(bridge_md, tiny_llama_dir):
    """docs/bridge.md's engine (online FourSight on the BF16 folder, on 127.0.0.1) and bridge lines as
    printed: an update from the --weights-dir folder is applied; the filter the page prints keeps sequences
    of 16 sampled ones scored by the BF16 model where the geo_mean band it printed before (0.999-1.001)
    keeps none; and the page's HF bridge line serves."""
    from transformers import AutoModelForCausalLM

    from foursight.trainer_bridge.client import RolloutClient
    from foursight.trainer_bridge.filters import FilterConfig, apply_filter
    from foursight.trainer_bridge.scoring import pad_rollouts, score

    assert listening_addresses(bridge_md["engine_port"]) == {"127.0.0.1"}
    save_file(perturbed_state(tiny_llama_dir, seed=21), str(bridge_md["policy"] / "step1.safetensors"))
    with RolloutClient(bridge_md["bridge"], api_key=bridge_md["key"]) as c:
        ack = c.update_weights(version=1, path=str(bridge_md["policy"] / "step1.safetensors"))
        assert ack["version"] == 1
        rollouts = list(c.stream([[5, 6, 7, 8], [11, 12, 13]], {"max_tokens": 16, "temperature": 1.0, "seed": 0}, n=8))
    assert len(rollouts) == 16 and {r.weight_version for r in rollouts} == {1}
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    hf.load_state_dict(perturbed_state(tiny_llama_dir, seed=21), strict=False)
    lt, lr, mask = pad_rollouts(rollouts, score(hf, rollouts))
    printed = re.search(r"FilterConfig\((.*?)\)\)", (ROOT / "docs/bridge.md").read_text()).group(1)
    cfg = eval(f"FilterConfig({printed})", {"FilterConfig": FilterConfig})  # the config exactly as the page prints it
    kept = float(apply_filter(lt, lr, mask, cfg).keep.float().mean())
    old = float(apply_filter(lt, lr, mask, FilterConfig(policy="geo_mean")).keep.float().mean())
    print(f"\nkept by the printed filter {kept:.2f}; by the old geo_mean example {old:.2f}")
    # the tiny random model under W4A4 drifts far more than SmolLM2 (where this filter kept 75-100 %,
    # docs/trl.md): unseeded, the share it kept here ranged from 1 to 7 of 16 between runs (CI of 2026-12-06
    # failed a 25 % bound with 1 of 16), so the samples are seeded and the claim is the page's: the printed
    # filter keeps sequences, the old example none
    assert kept > 0 and kept > old

    run = bridge_md["run"]
    url, _ = run.start(run.line("foursight bridge serve", "--engine hf"), "8100", "hf-bridge", 180, "/health")
    assert httpx.get(url + "/v1/weights", timeout=30).json()["version"] == 0
