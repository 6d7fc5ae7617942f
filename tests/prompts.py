"""Prompts from the demo model's domain (Python source), shared by the engine and GPU tests."""

PYTHON_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Parser:\n    \"\"\"Parse a configuration file.\"\"\"\n\n    def __init__(self, path):\n",
    "    for i in range(len(items)):\n        if items[i] is None:\n",
    "def read_lines(path, encoding='utf-8'):\n    with open(path, encoding=encoding) as f:\n",
    "# Copyright notice\n\"\"\"Utilities for working with temporary files.\"\"\"\n\nimport ",
    "        except KeyError:\n            raise ValueError('unknown key: %r' % (key,))\n",
]
