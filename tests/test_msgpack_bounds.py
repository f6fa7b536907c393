"""Decoding a bus body is bounded before it allocates (bus/events.py: unpack_bounded): a body built to
expand (millions of empty maps, each 1 byte on the wire and ~70 bytes as a dict; huge declared
lengths; deep nesting) is refused with an EventError, and the process's peak RSS grows by at most 4x
the body's size while refusing it (measured in a fresh process: /proc/self/clear_refs resets the
peak, VmHWM reads it). A real Rollout and Task still decode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack
import pytest

from bus.errors import EventError
from bus.events import Rollout, Task, decode, encode

MIB = 1 << 20

# each builds an ~8 MiB body in the child, as bytes
BODIES = {
    # one array32 of 8 Mi empty maps (fixmap 0x80)
    "array_of_empty_maps": "b'\\xdd' + (8 << 20).to_bytes(4, 'big') + b'\\x80' * (8 << 20)",
    # many arrays of 65535 empty maps each, inside one array: each under the per-array limit
    "arrays_of_empty_maps": "b'\\xdc\\x00\\x80' + (b'\\xdc\\xff\\xff' + b'\\x80' * 65535) * 128",
    # empty arrays (fixarray 0x90) inside maps with int keys
    "maps_of_empty_arrays": "b'\\xdc\\x00\\x80' + (b'\\xde\\x7f\\xff' + b'\\x00\\x90' * 32767) * 128",
    # a map declaring 2**32-1 pairs, a string declaring 4 GiB: refused at the header
    "huge_declared_lengths": "b'\\xdf\\xff\\xff\\xff\\xff' + b'\\xdb\\xff\\xff\\xff\\xff' + b'x' * (8 << 20)",
    # 8 Mi nested arrays
    "deep_nesting": "b'\\x91' * (8 << 20)",
}

CHILD = """
import gc, json, sys
from bus.events import decode
from bus.errors import EventError
body = {expr}
gc.collect()
def kb(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1])
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # the peak RSS restarts from the current RSS
base = kb('VmRSS:')
try:
    decode(body)
    err = ''
except EventError as e:
    err = str(e)
print(json.dumps({{'size': len(body), 'grew_kb': kb('VmHWM:') - base, 'error': err}}))
"""


@pytest.mark.parametrize("name", sorted(BODIES))
def test_an_amplification_body_is_refused_within_4x_its_size(name):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(expr=BODIES[name])],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["error"], got  # refused, an EventError
    assert got["size"] >= 8 * MIB - 1024
    assert got["grew_kb"] * 1024 <= 4 * got["size"], got
    print(name, got)


def test_real_events_still_decode_and_small_bodies_keep_their_floor():
    n = 1 << 17
    r = Rollout(
        rollout_id="t-0",
        task_id="t",
        env="swe",
        sample_index=0,
        group_size=1,
        prompt="p",
        spec={"files": {f"f{i}.py": "x" for i in range(2000)}, "tests": ["a", "b"]},
        prompt_ids=list(range(100, 200)),
        completion_ids=[5] * n,
        completion_text="x",
        logprobs=[-0.5] * n,
        token_versions=[1] * n,
        sampling={"temperature": 1.0},
        sampling_mask={"format": "full", "rows": n},
        quant={},
        finish_reason="length",
        cost_tokens=n,
        wall_s=1.0,
        worker_id="w",
        loss_mask=[1] * n,
    )
    assert decode(encode(r), Rollout).completion_ids == [5] * n
    t = Task(task_id="t", env="swe", prompt="p", spec={"meta": [{"k": i} for i in range(3000)]})
    assert len(decode(encode(t), Task).spec["meta"]) == 3000
    with pytest.raises(EventError, match="maps and arrays"):
        decode(msgpack.packb([{}] * 10_000))
