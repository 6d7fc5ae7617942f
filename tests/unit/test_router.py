"""The state-affinity router's record keys (serve_app/router.py): one per whole block of the
prompt, each standing for the whole prefix and the init state. The routing itself runs on real
replicas in tests/serve/test_routing.py."""

from __future__ import annotations

import os
import subprocess
import sys

from replicas.engine import Request
from serve_app.router import prefix_keys


def test_keys_stand_for_whole_prefixes_of_whole_blocks():
    a = Request(list(range(100)))
    b = Request(list(range(64)) + [7] * 40)
    assert len(prefix_keys(a, 32)) == 3  # 96 tokens in whole blocks; the last 4 give none
    assert prefix_keys(a, 32)[:2] == prefix_keys(b, 32)[:2]  # the first 64 tokens are shared
    assert prefix_keys(a, 32)[2] != prefix_keys(b, 32)[2]
    # a block alike but after another prefix is another key
    c = Request([9] * 32 + list(range(32, 64)))
    assert prefix_keys(c, 32)[1] != prefix_keys(a, 32)[1]


def test_keys_of_another_init_state_are_apart():
    prompt = list(range(64))
    plain, persona = prefix_keys(Request(prompt), 32), prefix_keys(Request(prompt, init_state="persona"), 32)
    assert not set(plain) & set(persona)


def test_short_prompts_and_calls_without_a_request_have_no_keys():
    assert prefix_keys(Request(list(range(31))), 32) == []
    assert prefix_keys(None, 32) == []


def test_keys_are_the_same_in_every_process():
    """The routers of several ingress replicas trade keys, so a key may not depend on the process:
    Python salts the hashes of strings per process (the init state's name seeded the keys so once,
    and two ingress replicas never found each other's routings)."""
    code = ("from replicas.engine import Request; from serve_app.router import prefix_keys; "
            "print(prefix_keys(Request(list(range(64)), init_state='persona'), 32))")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert runs[0] == runs[1] == f"{prefix_keys(Request(list(range(64)), init_state='persona'), 32)}\n"
