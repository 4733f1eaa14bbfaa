"""`gen profile` (and `gen timeline`) without a GPU: argument errors and the missing GPU are clear exits, not
tracebacks; with one, they ask the runtime for the layer's kernel."""
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



NCU_SAMPLE = __import__("pathlib").Path(__file__).parent / "data" / "ncu_source_sample.csv"


def test_without_shape_or_m_it_says_what_is_needed(capsys):
    assert main(["profile", "--m", "16"]) == 2
    assert "--shape and --m" in capsys.readouterr().err


def test_read_ncu_summarizes_where_the_warps_waited(capsys):
    # tests/data/ncu_source_sample.csv: five lines of ncu's source page (an earlier tune, gate_up at M = 16).
    assert main(["profile", "--read-ncu", str(NCU_SAMPLE), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "154112 warp instructions executed, 266 stall samples" in out
    assert "long_sb 0.59, wait 0.36, selected 0.05" in out          # 157 / 266, 96 / 266, 13 / 266
    assert "BRA 0.143/0.62" in out and "HGMMA 0.143/0.31" in out    # the guard @!P0 is not the opcode
    listed = out.split("lines with the most samples:\n")[1].splitlines()
    assert len(listed) == 2 and "BRA" in listed[0] and "long_sb 157" in listed[0] and "HGMMA" in listed[1]


def test_read_ncu_rejects_other_files(tmp_path, capsys):
    other = tmp_path / "details.txt"
    other.write_text("  Section: GPU Speed Of Light Throughput\n    Duration   us   20.48\n")
    assert main(["profile", "--read-ncu", str(other)]) == 2
    assert "--print-source sass" in capsys.readouterr().err
    assert main(["profile", "--read-ncu", str(tmp_path / "missing.csv")]) == 2


@pytest.mark.parametrize("command", ["profile", "timeline"])
def test_on_a_gpu_it_asks_the_runtime_for_the_layers_kernel(monkeypatch, command):
    import torch

    from runtime import dispatch

    def chosen(problem, m):
        raise LookupError(f"asked for {problem.name} at M={m}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dispatch, "schedule_for", chosen)
    with pytest.raises(LookupError, match="asked for n4096_k4096_g128_float16_w4 at M=16"):
        main([command, "--shape", "4096x4096", "--m", "16"])
