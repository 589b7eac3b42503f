"""The examples run end to end and report equality with HF eager."""
import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name,argv", [
    ("generate", ["--preset", "tiny", "--new-tokens", "4", "--prompt-len", "6"]),
    ("generate", ["--preset", "tiny", "--new-tokens", "4", "--prompt-len", "6", "--attention", "paged", "--batch", "2"]),
    ("generate", ["--preset", "tiny", "--new-tokens", "4", "--prompt-len", "6", "--attention", "hf"]),
    ("batch_generate", ["--preset", "tiny", "--lengths", "3", "11", "--new-tokens", "4"]),
])
def test_example_exits_zero(name, argv, capsys):
    assert _load(name).main(argv) == 0
    assert "tokens equal to HF eager: True" in capsys.readouterr().out


def test_stream_example_streams_every_token(capsys):
    _load("stream").main(["--preset", "tiny", "--new-tokens", "5"])
    assert "5 tokens streamed" in capsys.readouterr().out
