"""``FourSightVLLMClient``: TRL's ``VLLMClient`` whose weight sync goes through a FourSight bridge.

TRL 1.16's ``VLLMClient`` generates over vLLM's OpenAI routes (the bridge serves them) and syncs
weights over an NCCL group that only works between CUDA devices. This subclass keeps TRL's
generation and changes the sync: ``init_communicator`` checks that the server is a bridge (its
``/server_info`` names the ``foursight_bridge`` backend, :mod:`.routes.trl`), and
``update_named_params`` writes the tensors it is given to one safetensors file and posts its name
to the bridge's ``/update_weights``, which applies it as ``POST /v1/weights`` does (each engine
re-quantizes; one new weight version). Inside ``weight_update()`` the tensors are gathered and sent
once, at the end. With ``upload=True`` (a trainer on another host than the bridge) the file is sent
to the bridge over HTTP in chunks (``PUT /v1/weights/uploads/{name}``) and applied by name
(docs/scale-out.md). ``FourSightGRPOTrainer(..., rollout="foursight")`` in server mode builds this
client in place of TRL's.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Iterator

import torch

from foursight.trainer_bridge.routes.trl import BACKEND
from foursight.trainer_bridge.trl_warning import trl_version_warning_once

trl_version_warning_once()
from trl.generation.vllm_client import VLLMClient  # noqa: E402 (after the warning filter)


def _only_stale(r) -> bool:
    """A bridge's 503 ``/health`` whose every engine is up and answers, and some are only stale: a weight update repairs it."""
    try:
        engines = r.json()["engines"]
    except (ValueError, KeyError, TypeError):
        return False
    return bool(engines) and all(e.get("up") and (e.get("probe") or {}).get("ok", True) for e in engines) \
        and any(e.get("sync") == "stale" for e in engines)


class FourSightVLLMClient(VLLMClient):
    """TRL's ``VLLMClient`` for a FourSight bridge (same constructor, plus ``api_key`` and ``weights_dir``).

    Args:
        api_key: the bridge's API key (sent as ``Authorization: Bearer``), if it has one.
        weights_dir: where the weight files are written; it must be one of the bridge's
            ``--weights-dir`` folders. Default: ``/dev/shm`` (``$FOURSIGHT_SHM_DIR``), named by ``shm_name``.
            With ``upload``: where the file is written before it is sent (default: the system's temporary folder).
        upload: send each update's file to the bridge over HTTP (the trainer and the bridge on different
            hosts; the bridge needs a ``--weights-dir``), in chunks of ``upload_chunk_bytes`` (below the
            bridge's ``--max-body-bytes``, 32 MiB by default).
    """

    def __init__(self, *args, api_key: str | None = None, weights_dir: str | os.PathLike | None = None, upload: bool = False,
                 upload_chunk_bytes: int = 16 << 20, **kwargs):
        self.api_key = api_key
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self.upload, self.upload_chunk_bytes = upload, int(upload_chunk_bytes)
        self._pending: dict[str, torch.Tensor] = {}
        self.last_update: dict | None = None
        super().__init__(*args, **kwargs)

    def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0):
        """Wait for the bridge's ``/health``, at most ``total_timeout`` seconds (``connection_timeout``) whatever it
        answers: TRL's own check honours the timeout only on connection errors, so against a bridge answering 503 it
        polled forever. A bridge whose engines are up and only stale (they serve weights the bridge did not push,
        or a failed update's) is ready for this client: the update it pushes is what repairs them. After the timeout,
        :class:`ConnectionError` with the bridge's last answer."""
        import time

        import requests

        # the base constructor builds its session, then calls this before its first authenticated call
        if self.api_key:
            self.session.headers["Authorization"] = f"Bearer {self.api_key}"
        url, deadline, last = f"{self.base_url}/health", time.monotonic() + total_timeout, None
        while True:
            try:
                r = requests.get(url, timeout=max(1.0, min(30.0, total_timeout)))
            except requests.RequestException as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200 or (r.status_code == 503 and _only_stale(r)):
                    return
                last = f"{r.status_code} {r.text[:300]}"
            if time.monotonic() >= deadline:
                raise ConnectionError(f"the FourSight bridge at {self.base_url} was not ready within connection_timeout="
                                      f"{total_timeout:g} s; its last /health answer: {last}")
            time.sleep(max(0.0, min(retry_interval, deadline - time.monotonic())))

    def init_communicator(self, device: torch.device | str | int = 0):
        """Check that the server is a FourSight bridge (no NCCL group: weights travel as files)."""
        backend = (self.get_server_info().get("weight_transfer_config") or {}).get("backend")
        if backend != BACKEND:
            raise RuntimeError(f"{self.base_url} is not a FourSight bridge (weight_transfer_config backend {backend!r}); "
                               "FourSightVLLMClient syncs weights through `foursight bridge serve`")
        self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": {"backend": BACKEND}})

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]], named_params: Iterator[tuple[str, torch.Tensor]]):
        """Send the tensors (HF names; floats are sent as BF16) to the bridge as one weight update."""
        names = [m[0] for m in metadata]
        got: dict[str, torch.Tensor] = {}
        for name, t in named_params:
            # the bridge's weight protocol is BF16 (docs/bridge.md): a float32 learner's tensors are
            # rounded to nearest, the cast vLLM makes when a bfloat16 engine loads float32 weights
            dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
            got[name] = t.detach().to("cpu", dtype).contiguous()
        if list(got) != names:
            missing = sorted(set(names) - set(got)) or sorted(set(got) - set(names))
            raise ValueError(f"update_named_params: the tensors do not match their metadata (first differing name: {missing[:1]})")
        if self._updating_weights:
            self._pending.update(got)
        else:
            self._push(got)

    def _start_weight_update(self):
        self._pending = {}

    def _finish_weight_update(self):
        pending, self._pending = self._pending, {}
        if pending:
            self._push(pending)

    def _push(self, tensors: dict[str, torch.Tensor]) -> dict:
        from safetensors.torch import save_file

        from foursight.trainer_bridge.protocol import shm_path

        name = f"foursight-trl-{uuid.uuid4().hex}.safetensors"
        if self.upload:
            return self._push_upload(tensors, name)
        if self.weights_dir is not None:
            path = self.weights_dir / name
            info = {"path": str(path)}
        else:
            path = Path(shm_path(name))
            info = {"shm_name": name}
        try:
            save_file(tensors, str(path))
            info["names"] = list(tensors)
            self.last_update = self._post(f"{self.base_url}/update_weights", json={"update_info": info})
        finally:
            path.unlink(missing_ok=True)
        return self.last_update

    def _push_upload(self, tensors: dict[str, torch.Tensor], name: str) -> dict:
        """Write the file locally, send it to the bridge in chunks (the first answers the ``upload_id`` every later
        chunk carries; the bridge renames the upload when it holds the whole file), and apply it by its name. A
        failure deletes the upload this client started (the bridge keeps a refused one otherwise, for a retry)."""
        import tempfile

        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(dir=self.weights_dir) as tmp:
            path = Path(tmp) / name
            save_file(tensors, str(path))
            total = path.stat().st_size
            url = f"{self.base_url}/v1/weights/uploads/{name}"
            upload_id = None
            try:
                with open(path, "rb") as f:
                    offset, answer = 0, {}
                    while offset < total:  # chunks within the bridge's body limit
                        chunk = f.read(self.upload_chunk_bytes)
                        params = {"offset": offset, **({"upload_id": upload_id} if upload_id else {})}
                        r = self.session.put(url, params=params, data=chunk)
                        if r.status_code != 200:
                            raise RuntimeError(f"upload of {name} to {self.base_url}: {r.status_code} {r.text[:300]}")
                        answer = r.json()
                        upload_id = answer.get("upload_id", upload_id)
                        offset += len(chunk)
                if not answer.get("complete"):
                    raise RuntimeError(f"upload of {name} to {self.base_url}: the bridge holds {answer.get('size')} of {total} bytes "
                                       "after the last chunk")
                self.last_update = self._post(f"{self.base_url}/update_weights", json={"update_info": {"upload": name, "names": list(tensors)}})
            except BaseException:
                if upload_id is not None:
                    self.session.delete(url)
                raise
        return self.last_update

    def close_communicator(self):
        self.communicator = None
