"""`gen profile` without a GPU: argument errors and the missing GPU are clear exits, not tracebacks."""
import pytest

from gen.cli import main


@pytest.mark.parametrize("argv,fragment", [
    (["--shape", "4096x", "--m", "1"], "bad shape"),
    (["--shape", "4096x4096,4096x12288", "--m", "1"], "one KxN"),
    (["--shape", "4096x4096", "--m", "0"], "positive"),
])
def test_bad_arguments_exit_2(argv, fragment, capsys):
    assert main(["profile", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_without_a_gpu_it_says_so(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["profile", "--shape", "4096x4096", "--m", "16"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
