"""The `rwkv-fleet` command as a user runs it: a real process, real files.

A user's mistake ends as one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from replicas.model.checkpoint import load_model, save_pth
from replicas.model.config import ModelConfig
from replicas.model.loader import default_model_dir
from replicas.model.rwkv7 import RWKV7, init_random

SMALL = ModelConfig(n_layer=2, n_embd=64, head_size=32, vocab_size=65536, ffn_dim=96,
                    w_lora=8, a_lora=8, v_lora=4, g_lora=8)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve_app.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def refused(result: subprocess.CompletedProcess, words: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rwkv-fleet ") and "error:" in last and words in last, result.stderr


@pytest.fixture(scope="module")
def blinkdl_pth(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pth") / "RWKV-x070-test.pth"
    save_pth(init_random(RWKV7(SMALL), seed=3, scale=6.0), path, torch.bfloat16)
    return path


def test_convert_then_generate(blinkdl_pth, tmp_path):
    out = tmp_path / "model"
    converted = cli("convert", str(blinkdl_pth), str(out))
    assert converted.returncode == 0, converted.stderr
    assert "2 layers, width 64, 2 heads of 32" in converted.stderr  # progress a user sees
    model, card = load_model(out)
    assert model.config == SMALL and card.tokenizer == "rwkv_vocab_v20230424.txt" and card.eos_token_id == 0
    generated = cli("generate", "--model", str(out), "--max-tokens", "8", "--temperature", "0", "Hello")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip()
    again = cli("generate", "--model", str(out), "--max-tokens", "8", "--temperature", "0", "Hello")
    assert again.stdout == generated.stdout  # greedy is deterministic


def test_generate_uses_the_demo_model_by_default():
    result = cli("generate", "--max-tokens", "16", "--temperature", "0", "import os\n")
    assert result.returncode == 0, result.stderr
    assert "rwkv7-demo-pystdlib" in result.stderr
    fast = cli("generate", "--max-tokens", "16", "--temperature", "0", "--speculative-tokens", "4", "import os\n")
    assert fast.returncode == 0 and fast.stdout == result.stdout  # speculative decoding: the same text


def test_generate_in_json_mode_with_a_schema(tmp_path):
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    result = cli("generate", "--schema", str(tmp_path / "schema.json"), "--seed", "1", "--max-tokens", "400", "x = ")
    assert result.returncode == 0 and result.stderr.strip().endswith("stop]"), result.stderr
    value = json.loads(result.stdout)
    assert list(value) == ["name", "n"] and isinstance(value["name"], str) and type(value["n"]) is int


def test_generate_starts_from_a_state_tuned_file(tmp_path):
    demo = ModelConfig.from_tensors(load_file(default_model_dir() / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    tuned = {f"blocks.{i}.att.time_state": torch.randn(demo.n_head, demo.head_size, demo.head_size, generator=gen)
             for i in range(demo.n_layer)}  # RWKV-PEFT's layout
    torch.save(tuned, tmp_path / "tuned.pth")
    save_file(tuned, tmp_path / "tuned.safetensors")
    greedy = ("--max-tokens", "12", "--temperature", "0", "def ")
    texts = [cli("generate", *state, *greedy) for state in
             ((), ("--state", str(tmp_path / "tuned.pth")), ("--state", str(tmp_path / "tuned.safetensors")))]
    assert all(t.returncode == 0 for t in texts), [t.stderr for t in texts]
    plain, from_pth, from_safetensors = (t.stdout for t in texts)
    assert from_pth == from_safetensors != plain


def test_convert_refuses_a_file_that_is_not_a_checkpoint(tmp_path):
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"this is not a checkpoint")
    refused(cli("convert", str(junk), str(tmp_path / "out")), "not a PyTorch checkpoint")
    refused(cli("convert", str(tmp_path / "missing.pth"), str(tmp_path / "out")), "no such file")


def _tensors(pth: Path) -> dict:
    return torch.load(pth, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("damage, words", [
    (lambda t: t.pop("blocks.1.att.key.weight"), "missing tensor 'blocks.1.att.key.weight'"),
    (lambda t: t.__setitem__("blocks.0.ffn.value.weight", torch.zeros(64, 95)), "has shape [64, 95]"),
    (lambda t: t.__setitem__("blocks.0.att.time_faaaa", torch.zeros(2, 32)), "RWKV-5"),
    (lambda t: t.__setitem__("blocks.0.att.time_maa_x", torch.zeros(1, 1, 64)), "RWKV-6"),
    (lambda t: t.__setitem__("blocks.0.ffn.s_emb.weight", torch.zeros(65536, 32)), "DeepEmbed"),
    (lambda t: t.__setitem__("blocks.0.att.extra", torch.zeros(3)), "unexpected tensor"),
    (lambda t: t.pop("emb.weight"), "not an RWKV checkpoint"),
])
def test_convert_refuses_damaged_checkpoints(blinkdl_pth, tmp_path, damage, words):
    tensors = _tensors(blinkdl_pth)
    damage(tensors)
    bad = tmp_path / "bad.pth"
    torch.save(tensors, bad)
    refused(cli("convert", str(bad), str(tmp_path / "out")), words)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_convert_needs_a_tokenizer_for_another_vocabulary(tmp_path):
    config = ModelConfig(1, 64, 64, 300, 64, 4, 4, 4, 4)
    pth = tmp_path / "small-vocab.pth"
    save_pth(init_random(RWKV7(config), seed=1), pth)
    refused(cli("convert", str(pth), str(tmp_path / "out")), "--tokenizer")


def test_generate_refuses_bad_input_in_one_line(tmp_path):
    refused(cli("generate", "--model", str(tmp_path), "x"), "config.json")
    refused(cli("generate", "--temperature", "9", "x"), "temperature")
    refused(cli("generate", "--speculative-tokens", "99", "x"), "speculative-tokens: Input should be less")
    refused(cli("generate", "--state", str(tmp_path / "none.pth"), "x"), "none.pth: No such file")
    (tmp_path / "text.pth").write_text("not a state")
    refused(cli("generate", "--state", str(tmp_path / "text.pth"), "x"), "text.pth: not a safetensors file")
    (tmp_path / "string.json").write_text('{"type": "string"}')
    refused(cli("generate", "--schema", str(tmp_path / "string.json"), "x"), "schema: the root must be an object")
    refused(cli("generate", "--schema", str(tmp_path / "none.json"), "x"), "none.json: No such file")
    refused(cli("serve", "--port", "99999999"), "port: Input should be less than or equal to 65535")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  max_slots: 0\n")
    refused(cli("serve", "--config", str(bad)), "engine.max_slots")
    bad.write_text("engine: [\n")
    refused(cli("serve", "--config", str(bad)), "not valid YAML")
    bad.write_text("engine:\n  disk_cache_dir: states\n")
    refused(cli("serve", "--config", str(bad)), "disk_cache_bytes is 0")
    (tmp_path / "a file").write_text("")
    bad.write_text(f"engine:\n  disk_cache_bytes: 1000000\n  disk_cache_dir: {tmp_path / 'a file' / 'states'}\n")
    refused(cli("serve", "--config", str(bad)), "engine.disk_cache_dir")
    usage = cli("generate", "--max-tokens", "many", "x")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr


def test_batch_refuses_bad_files_in_one_line_before_sending_anything(tmp_path):
    def batch_file(*lines: str) -> str:
        path = tmp_path / "in.jsonl"
        path.write_text("\n".join(lines) + "\n")
        return str(path)

    good = '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}'
    out = str(tmp_path / "out.jsonl")
    unreachable = ("--url", "http://127.0.0.1:9")  # (nothing is sent: each file is refused first)
    refused(cli("batch", batch_file(good, "{nope"), out, *unreachable), "in.jsonl line 2: not JSON")
    refused(cli("batch", batch_file(good, good), out, *unreachable), "line 2: custom_id 'a' is used twice")
    refused(cli("batch", batch_file(good.replace("/v1/completions", "/v1/embeddings")), out, *unreachable),
            "line 1: url must be one of /v1/completions")
    refused(cli("batch", batch_file(good.replace('"POST"', '"GET"')), out, *unreachable), "method must be POST")
    refused(cli("batch", batch_file(good.replace('"x"}', '"x", "stream": true}')), out, *unreachable), "cannot stream")
    refused(cli("batch", batch_file(good.replace('"a"', "3")), out, *unreachable), "custom_id must be a non-empty")
    refused(cli("batch", batch_file(""), out, *unreachable), "no requests")
    refused(cli("batch", str(tmp_path / "none.jsonl"), out, *unreachable), "No such file")
    refused(cli("batch", batch_file(good), out, "--url", "ftp://host"), "an http:// or https:// address")
    refused(cli("batch", batch_file(good), out, *unreachable), "cannot reach http://127.0.0.1:9")
    refused(cli("batch", batch_file(good), out, *unreachable, "--concurrency", "0"), "--concurrency")
    refused(cli("batch", batch_file(good), out, *unreachable, "--model", "m"), "--model: for a server started here")
    refused(cli("batch", batch_file(good), str(tmp_path / "no" / "out.jsonl"), *unreachable), "no such directory")
    Path(out).write_text("")
    refused(cli("batch", batch_file(good), out, *unreachable), "out.jsonl exists: --resume goes on from it")
