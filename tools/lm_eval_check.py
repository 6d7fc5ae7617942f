"""lm-evaluation-harness against a running rwkv-fleet, checked against the model's own math.

`write DIR` puts a small multiple-choice task in DIR (no download: lm-eval reads it from there),
made from the Python standard library's source lines, which the demo model was trained on: each
question is a line's start, its choices the line's true end and three ends of other lines.
`check DIR` then reads the samples that lm-eval logged (`--log_samples --output_path DIR/out`),
computes each choice's loglikelihood with the model on the CPU in fp32 (rwkv7.py, tokenized as
lm-eval's `_encode_pair` splits a context from its continuation), and prints the largest
difference from what lm-eval got through the server, and whether every answer agrees.

    python tools/lm_eval_check.py write /tmp/lm-task
    rwkv-fleet serve &                                   # the demo model
    lm_eval --model local-completions --include_path /tmp/lm-task --tasks pystdlib_mc \
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=rwkv7-demo-pystdlib \
        --log_samples --output_path /tmp/lm-task/out
    python tools/lm_eval_check.py check /tmp/lm-task

lm-eval is not one of this project's dependencies: install it where you run it
(`pip install 'lm_eval[api]'`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
from pathlib import Path

QUESTIONS = 60
TASK = """task: pystdlib_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write(directory: Path) -> None:
    rng = random.Random(0)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = [s for f in sorted(stdlib.glob("*.py"))[:200] for s in
             (line.strip() for line in f.read_text(errors="ignore").splitlines())
             if 30 <= len(s) <= 70 and not s.startswith("#") and " " in s]
    rng.shuffle(lines)
    questions, others = lines[:QUESTIONS], lines[QUESTIONS:]
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "pystdlib_mc.jsonl"
    with data.open("w") as out:
        for line in questions:
            cut = line.rfind(" ", 10, len(line) - 5)
            ends = [line[cut:]] + [_end(other) for other in rng.sample(others, 3)]
            order = rng.sample(range(4), 4)
            doc = {"context": line[:cut], "choices": [ends[i] for i in order], "label": order.index(0)}
            out.write(json.dumps(doc) + "\n")
    (directory / "pystdlib_mc.yaml").write_text(TASK.format(data=data.resolve()))
    print(f"{QUESTIONS} questions in {data}; the task pystdlib_mc in {directory}")


def _end(line: str) -> str:
    cut = line.rfind(" ", 0, len(line) - 3)
    return line[cut:] if cut > 0 else " " + line


def check(directory: Path, model_dir: Path | None) -> int:
    import torch  # noqa: PLC0415

    from replicas.model.loader import default_model_dir, open_model  # noqa: PLC0415
    from replicas.model.rwkv7 import Rows  # noqa: PLC0415
    from replicas.model.state import RNNState  # noqa: PLC0415

    samples = sorted(directory.glob("out/*/samples_pystdlib_mc_*.jsonl"))
    if not samples:
        print(f"no samples under {directory}/out: run lm_eval with --log_samples --output_path {directory}/out",
              file=sys.stderr)
        return 1
    runner, tok, _ = open_model(model_dir or default_model_dir(), max_slots=1, device="cpu")
    worst, choices, agree, questions = 0.0, 0, 0, 0
    for line in samples[-1].read_text().splitlines():
        sample = json.loads(line)
        ours = []
        for arg, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = arg["arg_0"], arg["arg_1"]
            spaces = len(context) - len(context.rstrip())  # (lm-eval moves them to the continuation)
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            tokens = tok.encode(context + continuation)
            n = len(tok.encode(context))
            with torch.no_grad():
                logits, _ = runner.model(torch.tensor(tokens), Rows([len(tokens)]),
                                         RNNState.zeros(runner.config, 1), last_only=False)
            logprobs = torch.log_softmax(logits, dim=-1)
            ll = sum(logprobs[n - 1 + i, t].item() for i, t in enumerate(tokens[n:]))
            worst = max(worst, abs(ll - float(resp[0][0])))
            ours.append(ll)
            choices += 1
        best = max(range(len(ours)), key=ours.__getitem__)
        agree += float(best == int(sample["target"])) == sample["acc"]
        questions += 1
    print(f"{questions} questions, {choices} choices: largest |lm-eval's loglikelihood - the model's| "
          f"{worst:.1e}; the answer agrees on {agree}/{questions}")
    return 0 if agree == questions and worst < 1e-3 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["write", "check"])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--model", type=Path, help="check: the served model's directory (default: the demo model)")
    args = parser.parse_args()
    if args.what == "write":
        write(args.directory)
        return 0
    return check(args.directory, args.model)


if __name__ == "__main__":
    sys.exit(main())
