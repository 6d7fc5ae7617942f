"""After the runner's and the sampler's warm-up, serving compiles nothing: Triton specialises its
kernels on what follows from a call's shape, and a variant met for the first time while serving
held the whole batch for its compile (0.2-1 s each on the H200 machine; docs/gpu.md).

The compile check needs a CUDA GPU (the interpreter compiles nothing); the warm-up's calls are
checked on the CPU in tests/unit/test_call_shapes.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from replicas.model.config import ModelConfig
from replicas.model.rwkv7 import RWKV7, init_random
from replicas.sampling import Sampler, SamplingParams

from .conftest import CUDA

pytestmark = [pytest.mark.gpu]
SHAPE = ModelConfig(2, 256, 64, 1000, 1024, 32, 32, 32, 64)


@pytest.mark.skipif(not CUDA, reason="counts Triton's compiles on a CUDA GPU")
def test_serving_compiles_nothing_after_the_warm_up(monkeypatch):
    from triton.runtime import jit  # noqa: PLC0415

    from replicas.model.cuda_runner import CudaRunner  # noqa: PLC0415

    slots = 80  # (past AUTO_PATH_MAX: the last layer's tail also on cuBLAS)
    runner = CudaRunner(init_random(RWKV7(SHAPE), seed=5).to("cuda").eval(), max_slots=slots)
    sampler = Sampler(slots, SHAPE.vocab_size, "cuda")
    runner.warm_up()
    sampler.warm_up()
    # the slots as they were: new, at the zero state
    assert runner._fresh == set(range(slots))
    assert all(not t[:, :slots].any() for t in runner.states.tensors())
    compiled = []
    compile_one = jit.JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiled.append(self.fn.__name__)
        return compile_one(self, *args, **kwargs)

    monkeypatch.setattr(jit.JITFunction, "_do_compile", counting)
    rng = random.Random(0)
    for _ in range(120):
        rows = rng.sample(range(slots), rng.choice([1, 2, 3, rng.randrange(1, slots + 1)]))
        for slot in rows:
            if rng.random() < 0.5:
                runner.reset(slot)  # a new prompt
        lengths = [rng.choice([1, 2, rng.randrange(1, 40), rng.randrange(1, 400)]) for _ in rows]
        logits = runner.prefill(rows, [[rng.randrange(SHAPE.vocab_size) for _ in range(n)] for n in lengths])
        params = [rng.choice([SamplingParams(temperature=0.0), SamplingParams(top_p=0.9, top_k=40),
                              SamplingParams(presence_penalty=0.5)]) for _ in rows]
        tokens = sampler.sample(logits, rows, params, [rng.random() for _ in rows]).tokens
        runner.decode(rows, tokens)
    torch.cuda.synchronize()
    assert compiled == [], f"compiled while serving: {compiled}"
