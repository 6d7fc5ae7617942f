"""The registry actor itself, on the session's Ray: the stored responses kept in a file."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.serve


def _response(response_id: str, text: str = "ok") -> dict:
    return {"id": response_id, "object": "response", "output_text": text}


def test_stored_responses_come_back_from_their_file_in_a_new_registry(served, tmp_path):
    """Responses stored before and after the registry keeps them in a file come back, in order, in
    a registry that starts on the file, conversations whole; deleted ones do not, nor a line a
    crash cut short; one over the budget keeps the newest. The file is rewritten with the stored
    ones alone once it holds twice their bytes."""
    import ray

    from serve_app.registry import Registry

    path = str(tmp_path / "responses-app.jsonl")
    hi, there = [{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "there"}]
    first = Registry.remote()
    ray.get(first.put_response.remote(_response("resp_a"), None, hi))  # (before it keeps a file)
    assert ray.get(first.keep_responses_in.remote(path)) == 1
    ray.get([first.put_response.remote(_response("resp_b"), "resp_a", there),
             first.put_response.remote(_response("resp_c"), None, hi)])
    assert ray.get(first.delete_response.remote("resp_c"))
    assert ray.get(first.keep_responses_in.remote(path)) == 2  # (asked again by another ingress: nothing changes)
    ray.kill(first)

    second = Registry.remote()
    assert ray.get(second.keep_responses_in.remote(path)) == 2
    assert ray.get(second.conversation.remote("resp_b")) == hi + there
    assert ray.get(second.get_response.remote("resp_c")) is None
    assert ray.get(second.get_response.remote("resp_a"))["output_text"] == "ok"
    ray.kill(second)

    with open(path, "ab") as f:
        f.write(b'{"id": "resp_d", "previous": nu')  # a crash in the middle of a line
    small = Registry.remote(response_bytes=150)
    assert ray.get(small.keep_responses_in.remote(path)) == 1
    assert ray.get(small.get_response.remote("resp_b")) is not None and ray.get(
        small.get_response.remote("resp_a")) is None
    for i in range(50):  # the file holds twice its stored bytes and more: rewritten
        ray.get(small.put_response.remote(_response(f"resp_{i}", "x" * 100), None, hi))
    stored = ray.get(small.response_store.remote())
    ray.kill(small)
    with open(path, "rb") as f:
        lines = f.read().splitlines()
    assert stored["stored"] == 1 and len(lines) <= 4, len(lines)  # (52 lines without the rewrites)
