"""Cosmos3 action policy: a control loop on ``/generate/ws``, one socket, observations pipelined.

    mstar serve --config configs/cosmos3_droid.yaml   # nvidia/Cosmos3-Nano-Policy-DROID; a GPU
    python examples/cosmos3_action_ws_client.py [IMAGE|-] [CHUNKS] [DEPTH]

Each observation (IMAGE every time here, a robot's camera frame in a real loop; ``-`` or none: a
synthetic 320x176 frame) is appended to the socket's session and answered with one action chunk,
float32 ``[action_chunk_size, raw_action_dim]`` (the deployment's chunk; DROID's actions are 10
wide). DEPTH observations (default 2) are kept in flight, so the next one waits at the server
while a chunk is being made. Prints the chunk's shape and first action, then chunks/s, actions/s
and the latency percentiles (append sent -> chunk received). The fields: docs/cosmos3.md.
"""

import base64
import io
import json
import sys
import time

import numpy as np
from _common import BASE_URL
from websockets.sync.client import connect

RAW_ACTION_DIM = 10  # droid_lerobot's


def observation(path: str | None) -> bytes:
    if path:
        with open(path, "rb") as f:
            return f.read()
    from PIL import Image

    y, x = np.mgrid[0:176, 0:320]
    pixels = np.stack([x * 255 // 319, y * 255 // 175, (x + y) % 256], axis=-1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


image = observation(sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "-" else None)
chunks = int(sys.argv[2]) if len(sys.argv) > 2 else 8
depth = max(1, int(sys.argv[3]) if len(sys.argv) > 3 else 2)
append = json.dumps({"type": "append", "media": [base64.b64encode(image).decode()]})

sent: list[float] = []
latencies: list[float] = []
first = None
with connect(BASE_URL.replace("http", "ws", 1) + "/generate/ws", max_size=None) as ws:
    ws.send(json.dumps({"text": "Put the marker in the bowl.", "output_modalities": "action",
                        "model_kwargs": {"seed": 0, "raw_action_dim": RAW_ACTION_DIM}}))
    start = time.perf_counter()
    while len(sent) < min(depth, chunks):
        ws.send(append)
        sent.append(time.perf_counter())
    append_of = None
    while len(latencies) < chunks:
        message = ws.recv(timeout=600)
        if isinstance(message, bytes):  # a chunk, right after its header
            latencies.append(time.perf_counter() - sent[append_of])
            if first is None:
                first = np.frombuffer(message, dtype="<f4").reshape(-1, RAW_ACTION_DIM)
            if len(sent) < chunks:  # keep DEPTH observations in flight
                ws.send(append)
                sent.append(time.perf_counter())
            continue
        event = json.loads(message)
        if event["type"] == "error":
            sys.exit(f"error: {event.get('field')}: {event['message']}")
        if event["type"] == "output" and event["modality"] == "action":
            append_of = event["append"]
    elapsed = time.perf_counter() - start
    ws.send(json.dumps({"type": "end_input"}))
    while True:
        message = ws.recv(timeout=600)
        if isinstance(message, str) and json.loads(message)["type"] == "done":
            break

rows = first.shape[0]
print(f"chunk [{rows}, {RAW_ACTION_DIM}]; first action {np.round(first[0], 4).tolist()}")
ms = np.percentile(np.array(latencies) * 1000, [50, 90, 99])
print(f"{chunks} chunks in {elapsed:.2f} s: {chunks / elapsed:.2f} chunks/s, {chunks * rows / elapsed:.1f} actions/s; "
      f"latency p50 {ms[0]:.0f} ms, p90 {ms[1]:.0f} ms, p99 {ms[2]:.0f} ms")
