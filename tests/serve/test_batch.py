"""`rwkv-fleet batch --url` against the session's application: a real process, real HTTP.

The batch sends 32 requests at once, more than the two replicas' slots and waiting rows (4 and 4
each): whether the ingress's queue overflows into 503s depends on the machine's speed, so the
asking again is tested in tests/unit/test_batch.py, against a server that answers 503 on cue.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

N = 36


def batch_lines() -> list[dict]:
    lines = []
    for i in range(N):
        if i % 3 == 0:
            url, body = "/v1/completions", {"prompt": f"batch line {i}", "max_tokens": 6, "temperature": 0}
        elif i % 3 == 1:
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"line {i}"}],
                                                 "max_tokens": 6, "temperature": 0}
        else:
            url, body = "/v1/responses", {"input": f"line {i}", "max_output_tokens": 6, "temperature": 0}
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": "x", "temperature": -1}})
    return lines


def run_batch(tmp_path: Path, base_url: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve_app.cli", "batch", str(tmp_path / "in.jsonl"),
                           str(tmp_path / "out.jsonl"), "--url", base_url, "--concurrency", "32", *extra],
                          capture_output=True, text=True, timeout=300)


def text_of(body: dict) -> str:
    if body["object"] == "text_completion":
        return body["choices"][0]["text"]
    if body["object"] == "chat.completion":
        return body["choices"][0]["message"]["content"]
    return body["output"][0]["content"][0]["text"]


def test_a_batch_file_gets_each_answer_once_and_goes_on_after_an_interruption(tmp_path, base_url):
    lines = batch_lines()
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = run_batch(tmp_path, base_url)
    assert result.returncode == 0, result.stderr
    assert f"batch: {N} of {N + 1} requests succeeded" in result.stderr and "1 with status 400" in result.stderr

    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)
    by_id = {o["custom_id"]: o for o in out}
    assert by_id["bad"]["response"]["status_code"] == 400 and by_id["bad"]["error"] is None
    assert by_id["bad"]["response"]["body"]["error"]["param"] == "temperature"
    for line in lines[:-1]:
        answer = by_id[line["custom_id"]]
        assert answer["id"].startswith("batch_req_") and answer["error"] is None
        assert answer["response"]["status_code"] == 200
        assert answer["response"]["request_id"] == answer["response"]["body"]["id"]
    for line in lines[:3]:  # greedy: the same text as the request sent alone
        alone = httpx.post(base_url + line["url"], json=line["body"], timeout=60).json()
        assert text_of(by_id[line["custom_id"]]["response"]["body"]) == text_of(alone)

    # an earlier run killed while writing: five lines and half of the sixth
    kept = (tmp_path / "out.jsonl").read_text().splitlines(keepends=True)[:6]
    (tmp_path / "out.jsonl").write_text("".join(kept[:5]) + kept[5][: len(kept[5]) // 2])
    refused = run_batch(tmp_path, base_url)
    assert refused.returncode == 1 and "exists: --resume" in refused.stderr
    resumed = run_batch(tmp_path, base_url, "--resume", "--priority", "3")  # (the bodies take it: 200s)
    assert resumed.returncode == 0, resumed.stderr
    assert f"5 of {N + 1} requests are in" in resumed.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(line["custom_id"] for line in lines)
    assert sum(o["response"]["status_code"] == 200 for o in out) == N
    again = run_batch(tmp_path, base_url, "--resume")
    assert again.returncode == 0 and "nothing left to send" in again.stderr
