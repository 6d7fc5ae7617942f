"""Prompts from the demo model's domain (Python source), shared by the engine and GPU tests."""

PYTHON_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Parser:\n    \"\"\"Parse a configuration file.\"\"\"\n\n    def __init__(self, path):\n",
    "    for i in range(len(items)):\n        if items[i] is None:\n",
    "def read_lines(path, encoding='utf-8'):\n    with open(path, encoding=encoding) as f:\n",
    "# Copyright notice\n\"\"\"Utilities for working with temporary files.\"\"\"\n\nimport ",
    "        except KeyError:\n            raise ValueError('unknown key: %r' % (key,))\n",
]


def echo_prompt(cpu_runner, tokenizer) -> list[int]:
    """The first prompt, the 128 tokens the model writes after it (greedy, on a CPU runner's fp32
    path) and the prompt again: on the demo model, the 156 tokens whose powers of L broke the
    chunked prefill's inverse until 12-07e (docs/gpu-history.md)."""
    prompt = tokenizer.encode(PYTHON_PROMPTS[0])
    cpu_runner.reset(0)
    logits, answer = cpu_runner.prefill([0], [prompt]), []
    for _ in range(128):
        answer.append(int(logits[0].argmax()))
        logits = cpu_runner.decode([0], [answer[-1]])
    return echoed(prompt, answer, tokenizer)


def echoed(prompt: list[int], answer: list[int], tokenizer) -> list[int]:
    """A prompt, what the model wrote after it, three newlines and the prompt again: a conversation
    that asks for its last answer again (speculative decoding's "echo" workload)."""
    return prompt + answer + tokenizer.encode("\n\n\n") + prompt
