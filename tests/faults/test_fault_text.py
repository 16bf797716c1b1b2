"""Free text (ot.log_text, ot.log_samples): secrets in the forms people actually print are redacted
in the run directory's files, redaction stays linear on megabytes of text, and huge texts are cut
with a marker that says so."""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import otel_train as ot
from otel_train.redaction import TEXT_LIMIT
from otel_train.testing import current_session

SECRET = "sk-Q7fz29bXk"

# (form, what the run directory must hold instead): every one of these leaked in clear before.
QUOTED_FORMS = [
    (str(argparse.Namespace(api_key=SECRET, lr=0.1)), "Namespace(api_key='***', lr=0.1)"),
    (json.dumps({"api_key": SECRET, "lr": 0.1}), '{"api_key": "***", "lr": 0.1}'),
    (json.dumps(json.dumps({"token": SECRET})), '"{\\"token\\": \\"***\\"}"'),
    (f"export OPENAI_API_KEY='{SECRET}'", "export OPENAI_API_KEY='***'"),
    (f'export HF_TOKEN="{SECRET}"', 'export HF_TOKEN="***"'),
    (str({"hf_token": SECRET, "epochs": 3}), "{'hf_token': '***', 'epochs': 3}"),
    (f"train.py --hf-token {SECRET} --lr 0.1", "train.py --hf-token *** --lr 0.1"),
    (f"train.py --api-key={SECRET} --fp16", "train.py --api-key=*** --fp16"),
    (
        str(["train.py", "--hf-token", SECRET, "--lr", "0.1"]),
        "['train.py', '--hf-token', '***', '--lr', '0.1']",
    ),
    (f"db_password: {SECRET}", "db_password: ***"),
    (f"api_key={SECRET}&page=2", "api_key=***&page=2"),
    (f"Authorization: Bearer {SECRET}", "Authorization: ***"),
    (f"pushing to https://user:{SECRET}@hub.example/x", "pushing to https://***@hub.example/x"),
]
# Not secrets: these stay exactly as written.
PLAIN = [
    "lr=0.1 batch_size=32 max_new_tokens=128 tokenizer='gpt2' num_tokens: 4096",
    "the key idea: --fp16 --use-auth-token --seed 3",
    str(argparse.Namespace(model="gpt2", epochs=3)),
]


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_quoted_secret_forms_are_redacted_in_the_run_files(tmp_path) -> None:
    ot.init(output_dir=str(tmp_path), run_name="text", prometheus_port=0, verbosity=0, log_interval=2)
    session = current_session()
    forms = [form for form, _ in QUOTED_FORMS] + PLAIN
    for i, form in enumerate(forms):
        ot.log_text(f"t{i}", form)
    ot.log_samples([(form, f"output {i}") for i, form in enumerate(forms[:4])], name="a")
    ot.log_samples([(f"prompt {i}", form) for i, form in enumerate(forms[4:8])], name="b")
    for i in range(4):
        with ot.step(i):
            ot.record("loss", 1.0)
    ot.shutdown()

    run_dir = Path(session.run_dir)
    texts = {row["key"]: row["text"] for row in _read_jsonl(run_dir / "text.jsonl")}
    expected = [want for _, want in QUOTED_FORMS] + PLAIN
    assert [texts[f"t{i}"] for i in range(len(forms))] == expected
    samples = _read_jsonl(run_dir / "samples.jsonl")
    assert [row["prompt"] for row in samples if row["key"] == "a"] == expected[:4]
    assert [row["output"] for row in samples if row["key"] == "b"] == expected[4:8]
    leaks = [p.name for p in run_dir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaks == []


def test_redaction_is_linear_on_a_megabyte_of_base64() -> None:
    """The old pattern rescanned every long word from each position inside it: 11 s for 100 kB of
    base64, quadratic, so ~20 minutes for these 1 MB inputs. Linear, they take well under a
    second; the subprocess gets 60 s, so only a super-linear pattern fails (no timing asserted)."""
    blobs = {
        "base64": base64.b64encode(os.urandom(750_000)).decode(),
        "hex": os.urandom(500_000).hex(),
        "keys": ("api_key" * 40 + " ") * 3_500,  # secret-looking words with no value
        "flags": "--hf-token " * 90_000,
    }
    code = (
        "import json, sys\n"
        "from otel_train.redaction import redact_text\n"
        "blobs = json.load(sys.stdin)\n"
        "print(json.dumps({k: len(redact_text(v)) for k, v in blobs.items()}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps(blobs), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lengths = json.loads(done.stdout)
    assert lengths["base64"] == len(blobs["base64"]) and lengths["hex"] == len(blobs["hex"])


def test_huge_texts_and_samples_are_cut_and_say_so(tmp_path) -> None:
    ot.init(output_dir=str(tmp_path), run_name="big", prometheus_port=0, verbosity=0, log_interval=2)
    session = current_session()
    blob = base64.b64encode(os.urandom(750_000)).decode()  # 1,000,000 characters
    ot.log_text("payload", blob)
    ot.log_samples([(blob, blob), ("short prompt", blob), (blob, "short output")])
    for i in range(4):
        with ot.step(i):
            ot.record("loss", 1.0)
    ot.shutdown()

    marker = f" [... truncated by otel_train: {len(blob)} characters in all]"
    run_dir = Path(session.run_dir)
    (text,) = _read_jsonl(run_dir / "text.jsonl")
    assert text["text"] == blob[:TEXT_LIMIT] + marker
    rows = [(row["prompt"], row["output"]) for row in _read_jsonl(run_dir / "samples.jsonl")]
    cut = blob[:TEXT_LIMIT] + marker
    assert rows == [(cut, cut), ("short prompt", cut), (cut, "short output")]


def test_hyperparameters_keep_their_values_and_shapes_through_the_redaction() -> None:
    """Redaction changes secrets only: a numeric string stays a string ("1.10" is no 1.1, "0042" no
    42), a Namespace or dataclass stays a mapping (its secret fields redacted), numpy and torch
    scalars pass on as they are (each writer's plain() keeps their kind), a command line's flag
    value is hidden."""
    import dataclasses

    import numpy as np
    import torch

    from otel_train.redaction import REDACTED, redact

    @dataclasses.dataclass
    class Args:
        hf_token: str = "hf_abc"
        lr: float = 0.1

    given = {
        "version": "1.10", "seed": "0042", "schedule": "inf", "devices": "8",
        "args": argparse.Namespace(password="pw", layers=3), "cfg": Args(),
        "flag": np.bool_(True), "mask": torch.tensor(False), "steps": np.int64(7), "scale": torch.tensor(2.5),
        "argv": ["train.py", "--api-key", "K3Y", "--lr", "0.1"],
    }  # fmt: skip
    assert redact(given) == {
        "version": "1.10", "seed": "0042", "schedule": "inf", "devices": "8",
        "args": {"password": REDACTED, "layers": 3}, "cfg": {"hf_token": REDACTED, "lr": 0.1},
        "flag": True, "mask": False, "steps": 7, "scale": 2.5,
        "argv": ["train.py", "--api-key", REDACTED, "--lr", "0.1"],
    }  # fmt: skip
