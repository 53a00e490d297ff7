"""A learner process for the broadcast road's tests: rank 0 of a Gloo group (the CPU stand-in for TRL's NCCL
group) that broadcasts updates read from safetensors files, exactly as they are announced.

``python broadcast_learner.py SPEC.json``; SPEC: ``{"phases": [{"port", "world_size", "buffer_size_bytes",
"updates": [{"file", "names"}]}]}``: per phase, open the group (host 127.0.0.1) and broadcast each update's
tensors in ``names`` order, packed as vLLM's producer packs them (:func:`weight_broadcast.broadcast_packed`)."""

from __future__ import annotations

import json
import sys


def main(spec_path: str) -> None:
    from safetensors.torch import load_file

    from foursight.quant_methods.weight_broadcast import broadcast_packed, open_trainer_group

    spec = json.loads(open(spec_path).read())
    for phase in spec["phases"]:
        comm = open_trainer_group({"master_address": "127.0.0.1", "master_port": phase["port"], "world_size": phase["world_size"]}, "gloo")
        for upd in phase["updates"]:
            sd = load_file(upd["file"])
            broadcast_packed(iter([(n, sd[n]) for n in upd["names"]]), comm, buffer_size_bytes=phase["buffer_size_bytes"])
            print(f"sent {upd['file']}", flush=True)
        comm.close()
    print("LEARNER DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
