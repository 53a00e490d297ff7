"""Issue 53 (the user's road, round three), items 1-4, against one real vLLM CPU engine.

The engine is ``foursight serve`` (dev mode, the FourSight worker extension, a weights token and a weights
folder) on the FourSight checkpoint of a tiny Llama whose ``lm_head`` is tied to ``embed_tokens``, as
SmolLM2's is. Bridges in front of it run as ``foursight bridge serve`` processes (where a test checks that
the bridge process survives) or in this process (where a test needs bounds of its own). The tests run in
file order and leave the engine in sync for the next one.

Before (d00d877):
* item 1: an ``offset=0`` chunk reopened an upload with ``"wb"`` while the bridge or the engine read it (SIGBUS);
  two writers interleaved on one name; uploads had no bound and no expiry; a planted link was written
  through; a refused apply deleted the upload, so a retry got 422.
* item 2: a form post from any web page reached ``/collective_rpc`` (200, no key).
* item 3: ``reload_weights`` killed the engine (``missing tensor lm_head.weight``, layers left on the meta
  device), also from an unusable path; ``reset_weights`` zeroed the weights and the bridge stayed in sync.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("vllm")

from foursight.schema import ENV_WEIGHTS_DIR, ENV_WEIGHTS_TOKEN  # noqa: E402
from foursight.trainer_bridge.launch import BridgeThread, ServerProcess, free_port, wait_http_ok  # noqa: E402
from helpers.logprobs import server_prompt_logprobs  # noqa: E402
from helpers.weights import perturbed_state  # noqa: E402

pytestmark = [pytest.mark.vllm]

EXT = "foursight.quant_methods.vllm_weight_sync.FourSightWorkerExtension"
BIN = Path(sys.executable).parent
SEQS = [[5, 9, 13, 17, 21, 25, 29, 33], [40, 41, 42, 43, 44, 45]]
UPLOADS = ".foursight-uploads"
WEIGHTS_TOKEN_HEADER = "X-FourSight-Weights-Token"  # the wire name (foursight.schema.WEIGHTS_TOKEN_HEADER)


@pytest.fixture(scope="module")
def tied(tmp_path_factory, quantize_tiny):
    """A tiny Llama with tied embeddings and its FourSight checkpoint (k = 16)."""
    from foursight.models import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("tied") / "model", tie_word_embeddings=True)
    return model, quantize_tiny(model).out_dir


@pytest.fixture(scope="module")
def engine(tied, tmp_path_factory):
    model, ckpt = tied
    policy = tmp_path_factory.mktemp("policy")
    token = secrets.token_hex(16)
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", ENV_WEIGHTS_DIR: str(policy), ENV_WEIGHTS_TOKEN: token}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    srv = ServerProcess([str(BIN / "foursight"), "serve", str(ckpt), "--port", str(port), "--max-model-len", "512",
                         "--worker-extension-cls", EXT], env, port, tmp_path_factory.mktemp("logs") / "engine.log").start(400)
    try:
        yield SimpleNamespace(url=srv.url, token=token, policy=policy, model=model, ckpt=ckpt, server=srv,
                              checkpoint_logprobs=server_prompt_logprobs(srv.url, SEQS))
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def bridge(engine, tmp_path_factory):
    """``foursight bridge serve`` in front of the engine, as a process of its own, uploads into the engine's weights folder."""
    port = free_port()
    log = tmp_path_factory.mktemp("logs") / "bridge.log"
    env = {**os.environ, ENV_WEIGHTS_TOKEN: engine.token}
    env.pop("FOURSIGHT_BRIDGE_API_KEY", None)
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(BIN / "foursight"), "bridge", "serve", "--engine", "vllm", "--engine-url", engine.url,
                                 "--tokenizer", str(engine.model), "--port", str(port), "--weights-dir", str(engine.policy),
                                 "--wait", "120"], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(url + "/health?probe=false", 180, proc, what="bridge", log_path=log)
        yield SimpleNamespace(url=url, proc=proc, log=log)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def in_process_bridge(engine, **options) -> BridgeThread:
    """A bridge app in this process in front of the engine (options: ``create_app``'s), started."""
    from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine
    from foursight.trainer_bridge.server import create_app

    e = VLLMHTTPEngine(engine.url, tokenizer=engine.model, weights_token=engine.token)
    return BridgeThread(create_app([e], weights_dirs=[str(engine.policy)], **options)).start()


def policy_bytes(engine, seed: int) -> bytes:
    """A new policy's BF16 weights (every linear moved) as the bytes of a safetensors file."""
    from safetensors.torch import save

    return save(perturbed_state(engine.model, seed=seed))


def full_policy_bytes(engine, seed: int) -> bytes:
    """Every tensor of the model (norms and embeddings too), the linears moved: an update that repairs any state."""
    from safetensors.torch import load_file, save

    return save({**load_file(str(engine.model / "model.safetensors")), **perturbed_state(engine.model, seed=seed)})


def put(url: str, name: str, data: bytes, offset: int = 0, upload_id: str | None = None) -> httpx.Response:
    params = {"offset": offset, **({"upload_id": upload_id} if upload_id else {})}
    return httpx.put(f"{url}/v1/weights/uploads/{name}", params=params, content=data, timeout=60)


def upload(url: str, name: str, data: bytes, chunk: int = 1 << 20) -> dict:
    """Send ``data`` as upload ``name`` in chunks; the last answer (complete, with its path)."""
    upload_id, answer = None, {}
    for off in range(0, len(data), chunk):
        r = put(url, name, data[off:off + chunk], off, upload_id)
        assert r.status_code == 200, r.text
        answer = r.json()
        upload_id = answer.get("upload_id")  # (d00d877 had no upload_id: its behaviour is what the tests show, not a KeyError)
    assert answer.get("complete", answer["size"] == len(data)), answer
    return answer


def apply(url: str, name: str) -> httpx.Response:
    return httpx.post(url + "/update_weights", json={"update_info": {"upload": name}}, timeout=300)


def uploads_left(engine) -> list[str]:
    return sorted(os.listdir(engine.policy / UPLOADS)) if (engine.policy / UPLOADS).is_dir() else []


def served_equals_a_push_of(engine, url: str, data: bytes) -> bool:
    """The engine's teacher-forced logprobs now equal those after a push of ``data`` by path (bit for bit)."""
    now = server_prompt_logprobs(engine.url, SEQS)
    f = engine.policy / f"check-{secrets.token_hex(4)}.safetensors"
    f.write_bytes(data)
    try:
        v = httpx.get(url + "/v1/weights", timeout=30).json()["version"]
        r = httpx.post(url + "/v1/weights", json={"path": str(f), "version": v + 1}, timeout=300)
        assert r.status_code == 200, r.text
    finally:
        f.unlink()
    return all(torch.equal(a, b) for a, b in zip(now, server_prompt_logprobs(engine.url, SEQS)))


class HeldStream:
    """A rollout stream the bridge holds open until :meth:`release`: its reader takes the answer's status, then
    reads nothing more, so the bridge cannot finish sending (its samples carry top-20 logprobs, megabytes that no
    socket buffer holds) and keeps the stream's read of the version gate. An update started meanwhile waits in its
    drain however fast or slow the machine is (a stream of a fixed length ended before a loaded CI machine had
    checked the update's file: a flake)."""

    def __init__(self, url: str):
        self.answer: dict = {}
        self._go = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/v1/weights", timeout=30).json()["streams_open"] < 1:
            assert self.thread.is_alive() and time.monotonic() < deadline, f"the stream did not open: {self.answer}"
            time.sleep(0.01)

    def _run(self, url: str) -> None:
        with httpx.stream("POST", url + "/v1/rollouts", json={"prompts": [{"token_ids": [5, 6, 7]}], "n": 16,
                          "sampling": {"max_tokens": 480, "ignore_eos": True, "temperature": 1.0, "logprobs": 20}},
                          timeout=300) as r:
            self.answer["status"] = r.status_code
            self._go.wait(300)
            self.answer["lines"] = sum(1 for _ in r.iter_lines())

    def release(self) -> None:
        """Read the stream to its end (the bridge then releases its read of the gate)."""
        self._go.set()
        self.thread.join(300)
        assert self.answer.get("status") == 200 and self.answer.get("lines"), self.answer


def when_updating(url: str, done: dict, timeout_s: float = 60) -> None:
    """Wait until the bridge reports a weight update in progress (``done``: where the apply's answer lands)."""
    deadline = time.monotonic() + timeout_s
    while not httpx.get(url + "/v1/weights", timeout=30).json()["update_in_progress"]:
        assert time.monotonic() < deadline and "r" not in done, f"no update in progress; the apply answered {done.get('r')}"
        time.sleep(0.01)


# ---- item 1: uploads that cannot corrupt or kill


def test_a_truncating_put_during_an_apply_is_refused_and_both_processes_survive(engine, bridge):
    """The SIGBUS case: apply an upload, and while it is applied PUT one byte at ``offset=0`` of the same name.
    d00d877 answered 200 and truncated the file in place under the bridge's finiteness check (the bridge died
    of SIGBUS) or the engine's worker. Now the PUT is 409, the bridge and the engine live, and the engine serves
    exactly the uploaded file."""
    data = policy_bytes(engine, seed=31)
    name = "policy-31.safetensors"
    upload(bridge.url, name, data)
    stream = HeldStream(bridge.url)  # holds the update in its drain for the length of the stream
    done = {}
    applying = threading.Thread(target=lambda: done.setdefault("r", apply(bridge.url, name)), daemon=True)
    applying.start()
    when_updating(bridge.url, done)
    truncating = put(bridge.url, name, b"x")
    assert "r" not in done, done["r"].text  # the apply still waits for the held stream
    stream.release()
    applying.join(300)
    assert truncating.status_code == 409, truncating.text
    assert done["r"].status_code == 200, done["r"].text
    assert bridge.proc.poll() is None and engine.server.proc.poll() is None
    assert httpx.get(bridge.url + "/v1/health", timeout=60).status_code == 200
    assert uploads_left(engine) == []  # applied: removed
    assert served_equals_a_push_of(engine, bridge.url, data)


def test_one_writer_per_name_and_a_partial_upload_is_never_applied(engine, bridge):
    """A second writer on a name gets 409 while the first is open (d00d877 took both writers' chunks, and the
    applied file was half of each); a chunk must carry the writer's upload_id; a partial upload cannot be
    applied, by name or by the path of its private file; once complete the name takes no more chunks."""
    data = policy_bytes(engine, seed=32)
    name = "two-writers.safetensors"
    first = put(bridge.url, name, data[:4096])
    assert first.status_code == 200 and not first.json().get("complete"), first.text
    uid = first.json().get("upload_id")
    assert put(bridge.url, name, b"other writer").status_code == 409
    assert put(bridge.url, name, data[4096:8192], 4096).status_code == 409  # no upload_id: another writer
    assert put(bridge.url, name, data[4096:8192], 4096, "f" * 32).status_code == 409
    r = apply(bridge.url, name)
    assert r.status_code == 422 and "incomplete" in r.text, r.text
    part = next(p for p in uploads_left(engine) if p.endswith(".part"))
    r = httpx.post(bridge.url + "/v1/weights", json={"path": str(engine.policy / UPLOADS / part), "version": 10**6}, timeout=60)
    assert r.status_code == 422, r.text
    last = {}
    for off in range(4096, len(data), 1 << 20):
        last = put(bridge.url, name, data[off:off + (1 << 20)], off, uid).json()
    assert last["complete"] and last["size"] == len(data)
    assert put(bridge.url, name, b"more", len(data), uid).status_code == 409
    assert put(bridge.url, name, b"x").status_code == 409  # a complete upload waits for its apply or a DELETE
    assert apply(bridge.url, name).status_code == 200
    assert uploads_left(engine) == []
    assert served_equals_a_push_of(engine, bridge.url, data)


def test_uploads_are_bounded_and_expire(engine):
    """One upload is bounded (from Content-Length before the body is read, and by the size its safetensors header
    declares), all uploads together too (413 naming the flag); a partial upload not written for the TTL and a
    complete one never applied are removed. d00d877 took 768 MiB into one name and kept every upload forever."""
    data = policy_bytes(engine, seed=33)
    b = in_process_bridge(engine, max_upload_bytes=len(data) - 1)
    try:
        r = put(b.url, "big.safetensors", data)
        assert r.status_code == 413 and "--max-upload-bytes" in r.text, r.text
        r = put(b.url, "big.safetensors", data[:8192])  # the header already says the file is too big
        assert r.status_code == 413 and "header declares" in r.text, r.text
        assert uploads_left(engine) == []
    finally:
        b.stop()
    half = data[: len(data) // 2]
    b = in_process_bridge(engine, max_uploads_bytes=len(half) + 10, upload_ttl_s=2.0)
    try:
        assert put(b.url, "first.safetensors", half).status_code == 200
        r = put(b.url, "second.safetensors", half)
        assert r.status_code == 413 and "--max-uploads-bytes" in r.text, r.text
        time.sleep(2.5)
        r = put(b.url, "first.safetensors", b"late", len(half), "0" * 32)
        assert r.status_code == 422 and "no upload" in r.text, r.text  # expired: its file is gone
        assert uploads_left(engine) == []
    finally:
        b.stop()
    b = in_process_bridge(engine, upload_ttl_s=2.0)
    try:
        upload(b.url, "never-applied.safetensors", data)
        assert uploads_left(engine) == ["never-applied.safetensors"]
        time.sleep(2.5)
        assert apply(b.url, "never-applied.safetensors").status_code == 422
        assert uploads_left(engine) == []
    finally:
        b.stop()


def test_a_planted_link_in_the_upload_folder_is_never_followed(engine, bridge, tmp_path):
    """A link planted in the upload folder under an upload's name, or in place of the folder, is never written
    through (d00d877 opened the path with ``"wb"`` and overwrote the link's target)."""
    target = tmp_path / "victim.txt"
    target.write_text("the operator's file")
    folder = engine.policy / UPLOADS
    folder.mkdir(exist_ok=True)
    (folder / "planted.safetensors").symlink_to(target)
    try:
        assert put(bridge.url, "planted.safetensors", b"overwrite").status_code == 409
        assert apply(bridge.url, "planted.safetensors").status_code == 422
    finally:
        (folder / "planted.safetensors").unlink()
    root = tmp_path / "root"
    root.mkdir()
    (root / UPLOADS).symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir()
    from foursight.trainer_bridge.backends.vllm import VLLMHTTPEngine
    from foursight.trainer_bridge.server import create_app

    b = BridgeThread(create_app([VLLMHTTPEngine(engine.url, tokenizer=engine.model, weights_token=engine.token)],
                                weights_dirs=[str(root)])).start()
    try:
        r = put(b.url, "x.safetensors", b"data")
        assert r.status_code == 409 and "not a folder" in r.text, r.text
    finally:
        b.stop()
    assert target.read_text() == "the operator's file" and not any((tmp_path / "elsewhere").iterdir())


def test_a_refused_apply_keeps_the_upload_so_a_retry_works(engine, bridge):
    """The issue's case: an apply answered 409 (another update in progress) deleted the upload in a ``finally``,
    so the trainer's retry got 422 'not an upload of this bridge'. Now a refused apply (409 here, 422 for a bad
    file) keeps it until the apply succeeds or a DELETE removes it."""
    data = policy_bytes(engine, seed=35)
    upload(bridge.url, "first.safetensors", data)
    upload(bridge.url, "retried.safetensors", policy_bytes(engine, seed=36))
    stream = HeldStream(bridge.url)
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", apply(bridge.url, "first.safetensors")), daemon=True)
    t.start()
    when_updating(bridge.url, done)
    refused = apply(bridge.url, "retried.safetensors")
    assert "r" not in done, done["r"].text  # the first apply still waits for the held stream
    stream.release()
    t.join(300)
    assert refused.status_code == 409 and "in progress" in refused.text, refused.text
    assert done["r"].status_code == 200
    assert uploads_left(engine) == ["retried.safetensors"]
    assert apply(bridge.url, "retried.safetensors").status_code == 200  # the retry
    from safetensors.torch import load_file, save

    bad = load_file(str(engine.model / "model.safetensors"))
    bad["model.norm.weight"][0] = float("nan")

    upload(bridge.url, "bad.safetensors", save(bad))
    assert apply(bridge.url, "bad.safetensors").status_code == 422
    assert uploads_left(engine) == ["bad.safetensors"]
    assert httpx.delete(bridge.url + "/v1/weights/uploads/bad.safetensors", timeout=30).json()["deleted"]
    assert uploads_left(engine) == []


def test_trls_own_retry_applies_the_upload_after_a_failed_apply(engine, tmp_path):
    """TRL's client retries a POST answered 5xx (its session's urllib3 Retry). FourSightVLLMClient(upload=True)
    pushes while the engine refuses the bridge's call (a wrong weights token, made right again once the bridge
    has answered the first 502): TRL's retry finds the upload the failed apply kept and the update lands."""
    from transformers import AutoModelForCausalLM

    from foursight.trainer_bridge.trl import FourSightVLLMClient

    b = in_process_bridge(engine)
    try:
        state = b.server.config.app.state.bridge
        (e,) = state.engines
        v0 = state.gate.version
        errors = state.metrics.errors.labels(kind="weight_update")
        failed_before = errors._value.get()
        trainer = tmp_path / "trainer"
        trainer.mkdir()
        c = FourSightVLLMClient(base_url=b.url, upload=True, weights_dir=trainer, connection_timeout=30)
        c.init_communicator(device="cpu")
        model = AutoModelForCausalLM.from_pretrained(engine.model, dtype=torch.bfloat16)
        model.load_state_dict(perturbed_state(engine.model, seed=38), strict=False)
        e.weights_token = "not-" + engine.token

        def heal():
            while errors._value.get() == failed_before:
                time.sleep(0.01)
            e.weights_token = engine.token

        healer = threading.Thread(target=heal, daemon=True)
        healer.start()
        c.update_model_params(model)
        healer.join(5)
        assert errors._value.get() > failed_before  # the first apply failed (502) ...
        assert c.last_update["version"] == v0 + 1  # ... and TRL's retry applied the kept upload
        assert uploads_left(engine) == []
        assert httpx.get(b.url + "/v1/health?probe=false", timeout=60).json()["engines"][0]["sync"] == "in_sync"
    finally:
        b.stop()


# ---- item 2: the engine's dev routes behind the bridge's authority


def test_the_engines_dev_routes_need_the_weights_token_json_and_no_foreign_origin(engine):
    """d00d877: a form post (``Content-Type: text/plain``, ``Origin: http://evil.example``, no key) to
    ``/collective_rpc`` answered 200, and ``reset_weights`` zeroed the engine. ``foursight serve`` now mounts
    the guard (vLLM's ``--middleware``): without the token 401, a foreign Origin 403, a body that is not JSON
    415, for ``/collective_rpc``, the weight-transfer routes and the other state-changing dev routes; the
    OpenAI routes are untouched; the engine's weights did not move."""
    before = server_prompt_logprobs(engine.url, SEQS)
    rpc = engine.url + "/collective_rpc"
    form = httpx.post(rpc, content='{"method": "reset_weights"}', headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert form.status_code == 403, form.text
    assert httpx.post(rpc, json={"method": "reset_weights"}).status_code == 401
    tok = {WEIGHTS_TOKEN_HEADER: engine.token}
    assert httpx.post(rpc, json={"method": "reset_weights"}, headers={WEIGHTS_TOKEN_HEADER: "not-" + engine.token}).status_code == 401
    assert httpx.post(rpc, content='{"method": "reset_weights"}', headers={**tok, "Content-Type": "text/plain"}).status_code == 415
    assert httpx.post(rpc, json={"method": "reset_weights"}, headers={**tok, "Origin": "http://evil.example"}).status_code == 403
    for route, body in (("/update_weight_version", {"new_version": "666"}), ("/reset_prefix_cache", {}), ("/sleep", {}),
                        ("/init_weight_transfer_engine", {"init_info": {}}), ("/start_weight_update", {})):
        r = httpx.post(engine.url + route, json=body)
        assert r.status_code == 401, (route, r.status_code, r.text)
    assert all(torch.equal(a, b) for a, b in zip(server_prompt_logprobs(engine.url, SEQS), before))
    r = httpx.post(rpc, json={"method": "foursight_weight_version"}, headers=tok)  # the bridge's road: token and JSON
    assert r.status_code == 200, r.text
    assert httpx.get(engine.url + "/v1/models").status_code == 200


# ---- item 3: FourSight survives vLLM's own weight RPCs


def rpc(engine, method: str, **kwargs) -> httpx.Response:
    """vLLM's ``/collective_rpc`` with the token (the authority's own call: the guard lets it through)."""
    return httpx.post(engine.url + "/collective_rpc", json={"method": method, "kwargs": kwargs},
                      headers={WEIGHTS_TOKEN_HEADER: engine.token}, timeout=300)


def sync(url: str) -> dict:
    return httpx.get(url + "/v1/health?probe=false", timeout=60).json()["engines"][0]


def rollouts_status(url: str) -> int:
    return httpx.post(url + "/v1/rollouts", json={"prompts": [{"token_ids": [5, 6, 7]}], "sampling": {"max_tokens": 2}},
                      timeout=120).status_code


def test_reload_weights_with_tied_embeddings_works_and_the_bridge_stops_serving_the_engine(engine, bridge):
    """d00d877: ``reload_weights`` answered 500 and the engine died (``missing tensor lm_head.weight``: the
    checkpoint ties lm_head to embed_tokens; the reload was left half done). Now it reloads the checkpoint (the
    logprobs are the engine's at start, bit for bit), and the bridge, which had pushed other weights, sees a
    weights id it did not push: health and rollouts 503 until the next update."""
    data = policy_bytes(engine, seed=41)
    upload(bridge.url, "before-reload.safetensors", data)
    assert apply(bridge.url, "before-reload.safetensors").status_code == 200
    assert sync(bridge.url)["sync"] == "in_sync"
    r = rpc(engine, "reload_weights")
    assert r.status_code == 200, r.text
    assert all(torch.equal(a, b) for a, b in zip(server_prompt_logprobs(engine.url, SEQS), engine.checkpoint_logprobs))
    st = sync(bridge.url)
    assert st["sync"] == "stale" and "reload_weights" in st["reason"], st
    assert rollouts_status(bridge.url) == 503
    upload(bridge.url, "after-reload.safetensors", data)
    assert apply(bridge.url, "after-reload.safetensors").status_code == 200
    assert sync(bridge.url)["sync"] == "in_sync" and rollouts_status(bridge.url) == 200


def test_reload_weights_from_an_unusable_path_is_refused_before_any_layer_changes(engine, bridge, tmp_path):
    """An unusable ``weights_path`` (none, a BF16 folder for this FourSight engine, a copy of the checkpoint outside
    the weights folders, one inside with a NaN) is refused naming why, before vLLM touches a layer: the engine
    serves the same logprobs, its weights id is unchanged, and the bridge keeps serving it (d00d877: the engine died)."""
    import shutil

    from safetensors.torch import load_file

    before = server_prompt_logprobs(engine.url, SEQS)
    outside = Path(shutil.copytree(engine.ckpt, tmp_path / "outside"))
    nan = Path(shutil.copytree(engine.ckpt, engine.policy / "nan-ckpt"))
    t = load_file(str(nan / "model.safetensors"))
    t["model.norm.weight"][0] = float("nan")
    save_file(t, str(nan / "model.safetensors"), metadata={"format": "pt"})
    try:
        for path, why in ((tmp_path / "none", "not inside this engine's weights folders"),
                          (engine.policy / "none", "not a checkpoint folder"),
                          (outside, "not inside this engine's weights folders"),
                          (nan, "model.norm.weight")):
            r = rpc(engine, "reload_weights", weights_path=str(path))
            assert r.status_code != 200 and "FourSight refused" in r.text and why in r.text, (path, r.text[:400])
        shutil.copytree(engine.model, engine.policy / "bf16")
        r = rpc(engine, "reload_weights", weights_path=str(engine.policy / "bf16"))
        assert r.status_code != 200 and "another quantization_config" in r.text, r.text[:400]
    finally:
        shutil.rmtree(nan)
        shutil.rmtree(engine.policy / "bf16", ignore_errors=True)
    assert engine.server.proc.poll() is None
    assert all(torch.equal(a, b) for a, b in zip(server_prompt_logprobs(engine.url, SEQS), before))
    assert sync(bridge.url)["sync"] == "in_sync" and rollouts_status(bridge.url) == 200


def test_reset_weights_makes_the_bridge_stop_serving_the_engine_until_a_good_update(engine, bridge):
    """d00d877: ``reset_weights`` answered 200 and zeroed every weight while the bridge stayed ``in_sync`` and tagged
    token-0 rollouts with the trainer's version. Now any RPC that changes the weights gives the engine a new
    weights id: health and rollouts 503 naming it, until an update brings it back, after which the engine
    serves exactly that update (FourSight keeps the layers' channel sets through the reset, which a BF16 update
    cannot give back). vLLM's ``/weight_checker {"action": "reset"}`` likewise."""
    data = full_policy_bytes(engine, seed=42)
    r = rpc(engine, "reset_weights")
    assert r.status_code == 200, r.text
    st = sync(bridge.url)
    assert st["sync"] == "stale" and "reset_weights" in st["reason"], st
    assert httpx.get(bridge.url + "/v1/health?probe=false", timeout=60).status_code == 503
    assert rollouts_status(bridge.url) == 503
    upload(bridge.url, "after-reset.safetensors", data)
    assert apply(bridge.url, "after-reset.safetensors").status_code == 200
    assert sync(bridge.url)["sync"] == "in_sync"
    assert served_equals_a_push_of(engine, bridge.url, data)
    r = httpx.post(engine.url + "/weight_checker", json={"action": "reset"}, headers={WEIGHTS_TOKEN_HEADER: engine.token}, timeout=120)
    assert r.status_code == 200, r.text
    assert sync(bridge.url)["sync"] == "stale" and rollouts_status(bridge.url) == 503
    upload(bridge.url, "after-checker.safetensors", data)
    assert apply(bridge.url, "after-checker.safetensors").status_code == 200
    assert sync(bridge.url)["sync"] == "in_sync"


# ---- item 4: requests wait during an update; TRL's client against a degraded bridge; engines a bridge cannot update


def test_new_requests_wait_at_the_gate_during_an_update_and_none_gets_503(engine, bridge):
    """d00d877: 200 streams with an update 1.5 s in, 9 answered 503 ('no engine serves the current weights'): a
    request read the engine's state while the update was being applied (the engine already reported the new
    version, the bridge had not recorded it yet). Now a new request waits at the version gate first: requests sent
    back to back by 8 clients through 3 updates all get 200."""
    data = full_policy_bytes(engine, seed=43)
    f = engine.policy / "gate.safetensors"
    f.write_bytes(data)
    statuses: list[int] = []
    stop = threading.Event()

    def client():
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                statuses.append(c.post(bridge.url + "/v1/rollouts", json={"prompts": [{"token_ids": [5, 6, 7]}],
                                       "sampling": {"max_tokens": 2}}).status_code)

    workers = [threading.Thread(target=client, daemon=True) for _ in range(8)]
    try:
        for w in workers:
            w.start()
        time.sleep(1.0)
        for _ in range(3):
            v = httpx.get(bridge.url + "/v1/weights", timeout=30).json()["version"]
            r = httpx.post(bridge.url + "/v1/weights", json={"path": str(f), "version": v + 1}, timeout=300)
            assert r.status_code == 200, r.text
            time.sleep(0.5)
    finally:
        stop.set()
        for w in workers:
            w.join(300)
        f.unlink()
    print(f"\n{len(statuses)} requests through 3 updates: {sorted(set(statuses))}")
    assert len(statuses) > 20 and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}


def test_trls_client_honours_its_connection_timeout_and_repairs_a_stale_bridge(engine, bridge):
    """d00d877: FourSightVLLMClient(..., connection_timeout=60) polled a bridge answering 503 (engine stale) for 8.5
    min and never returned (TRL's check honours the timeout only on connection errors), so the trainer restarted to
    repair the bridge hung instead of pushing the update that repairs it. Now it returns against a bridge that is
    only stale and pushes that update; against one that never gets ready it raises after the timeout."""
    from transformers import AutoModelForCausalLM

    from foursight.trainer_bridge.trl import FourSightVLLMClient

    assert rpc(engine, "reset_weights").status_code == 200
    assert httpx.get(bridge.url + "/health", timeout=60).status_code == 503
    made: dict = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: made.setdefault("c", FourSightVLLMClient(base_url=bridge.url, weights_dir=engine.policy,
                                                                                 connection_timeout=5)), daemon=True)
    t.start()
    t.join(60)
    assert "c" in made, "FourSightVLLMClient did not return within 60 s against a stale bridge"
    print(f"\nthe client was ready after {time.monotonic() - t0:.1f} s")
    c = made["c"]
    c.init_communicator(device="cpu")
    from safetensors.torch import load

    model = AutoModelForCausalLM.from_pretrained(engine.model, dtype=torch.bfloat16)
    model.load_state_dict(load(full_policy_bytes(engine, seed=44)), strict=False)
    c.update_model_params(model)
    assert sync(bridge.url)["sync"] == "in_sync" and httpx.get(bridge.url + "/health", timeout=60).status_code == 200
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConnectionError):
        FourSightVLLMClient(base_url=f"http://127.0.0.1:{port}", connection_timeout=2)
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("case", ["native without its flag", "another weights token"])
def test_bridge_serve_refuses_an_engine_it_could_never_update(engine, case):
    """d00d877: ``bridge serve --weight-sync native`` in front of an engine without ``--weight-transfer-config``
    started, its first update was 502 and every route 503 for good; a bridge with another weights token than the
    engine's started without a word and failed its first update. Now ``bridge serve`` refuses both at start, exit 2,
    naming the missing flag or the token."""
    args, env = [], {**os.environ, ENV_WEIGHTS_TOKEN: engine.token}
    if case == "native without its flag":
        args, want = ["--weight-sync", "native"], "--weight-transfer-config"
    else:
        env[ENV_WEIGHTS_TOKEN], want = "not-" + engine.token, ENV_WEIGHTS_TOKEN
    env.pop("FOURSIGHT_BRIDGE_API_KEY", None)
    r = subprocess.run([str(BIN / "foursight"), "bridge", "serve", "--engine", "vllm", "--engine-url", engine.url, "--tokenizer",
                        str(engine.model), "--port", str(free_port()), "--wait", "60", *args],
                       env=env, capture_output=True, text=True, timeout=120)
    print(r.stderr[-600:])
    assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
